"""sglang's own flags, read by sglang's own parser before sglang starts: unknown flags (with the closest
of ours or sglang's), invalid values, what our backend refuses, and the model's config.json. Each
refusal is one line and exit code 2, with sglang never started and nothing written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import sgl_hicache.launch_server as launch_server
from sgl_hicache.server import sglang_args
from sgl_hicache.server.model_check import HYBRID_SWA_ARCHS, SSM_MODEL_TYPES
from sgl_hicache.server.sglang_seam import SeamError
from sgl_hicache.tier.file.volume import human
from tests.server.launcher import PREFIX, refusal, run_main

HUB_ID = "sgl-hicache-test/no-such-model"  # not a local path: left to sglang (which would download it)
DENSE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2}
MODELS: dict[str, dict[str, Any]] = {
    "dense": DENSE,
    "swa": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"},
    "swa_opt_in": {**DENSE, "is_hybrid_swa": True},
    "ssm": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"},
    "ssm_layers": {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
                   "layer_types": ["mamba", "attention"]},
    "multimodal": {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                   "vision_config": {"model_type": "clip_vision_model"}, "text_config": {"model_type": "llama"}},
    "mm_off_by_default": {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                          "text_config": {"model_type": "gemma3_text"}, "vision_config": {}},
}  # fmt: skip


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    return tmp_path / "tier"


def spill(tier: Path, *args: str) -> list[str]:
    return [
        "--model-path",
        HUB_ID,
        "--enable-hicache-spill",
        "--hicache-spill-dir",
        str(tier),
        *args,
    ]


def model_dir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(MODELS[name]))
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-total-tokns", "1024"], "unknown flag --max-total-tokns (did you mean --max-total-tokens?)"),
        (["--enable-hicache-spil"], "unknown flag --enable-hicache-spil (did you mean --enable-hicache-spill?)"),
        (["stray"], "unexpected argument 'stray'"),
        (["--schedule-policy", "bogus"], "argument --schedule-policy: invalid choice: 'bogus'"),
        (["--enable-hierarchical-cache"],
         "--enable-hierarchical-cache: not supported with the hicache_spill backend (it replaces sglang's HiCache"),
        (["--enable-hierarchical"], "--enable-hierarchical-cache: not supported with the hicache_spill backend"),
        (["--speculative-algorithm", "EAGLE"],
         "--speculative-algorithm EAGLE: not supported with the hicache_spill backend yet"),
        (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm NGRAM: not supported"),
    ],
)  # fmt: skip
def test_sglang_flags_are_refused_by_sglangs_parser(tier: Path, args: list[str], message: str) -> None:
    line = refusal(run_main(spill(tier, *args)))
    assert line.startswith(message), line
    assert not tier.exists()


def test_what_only_our_backend_refuses_passes_without_it() -> None:
    run = run_main(
        ["--model-path", HUB_ID, "--enable-hierarchical-cache", "--speculative-algorithm", "EAGLE"]
    )
    assert run.code == 0 and run.stderr == "" and len(run.started) == 1
    for args in (
        ["--disable-radix-cache"],
        ["--disaggregation-mode", "prefill"],
        ["--disaggregation-mode", "decode"],
    ):
        run = run_main(["--model-path", HUB_ID, *args])
        assert run.code == 0 and run.stderr == "" and len(run.started) == 1, args


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disable-radix-cache"], "--disable-radix-cache: not supported with the hicache_spill backend (it spills "
                                    "what the radix cache evicts: without one it would spill and restore nothing)"),
        (["--disable-radix"], "--disable-radix-cache: not supported with the hicache_spill backend"),
        (["--disaggregation-mode", "prefill"],
         "--disaggregation-mode prefill: not supported with the hicache_spill backend yet (sglang sends a request's "
         "cached prefix to the decode server without waiting for its restore from the tier to land, so the decode "
         "server could receive KV not yet written)"),
        (["--disaggregation-mode=decode"], "--disaggregation-mode decode: not supported with the hicache_spill backend"),
    ],
)  # fmt: skip
def test_a_server_our_backend_would_not_serve_is_refused(tier: Path, args: list[str], message: str) -> None:
    """Without a radix cache spill does nothing (silently, before); a prefill or decode server of a
    disaggregation could send KV that a restore has not written yet."""
    line = refusal(run_main(spill(tier, *args)))
    assert line.startswith(message), line
    assert not tier.exists()
    assert run_main(spill(tier, "--disaggregation-mode", "null")).code == 0


@pytest.mark.parametrize("path", ["/nonexistent-model", "./no-such-model", "../no-such-model", "~/no-such-model",
                                  "~sgl-hicache-no-such-user/m"])  # fmt: skip
def test_a_local_model_path_that_does_not_exist_is_refused(tier: Path, path: str) -> None:
    """sglang would take it for a Hugging Face id and fail after its start; with or without our backend."""
    assert (
        refusal(run_main(spill(tier, "--model-path", path)))
        == f"--model-path {path}: no such file or directory"
    )
    assert refusal(run_main(["--model-path", path])) == f"--model-path {path}: no such file or directory"
    assert not tier.exists()


def test_a_model_path_under_an_unexpanded_home_names_the_expanded_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    line = refusal(run_main(["--model-path", "~/m"]))
    assert (
        line
        == f"--model-path ~/m: no such file or directory (sglang does not expand ~: give {tmp_path / 'm'})"
    )


@pytest.mark.parametrize("path", [HUB_ID, "no-such-org/no-such-model", "models/local-looking"])
def test_a_model_path_that_may_be_a_hub_id_is_left_to_sglang(tier: Path, path: str) -> None:
    assert run_main(spill(tier, "--model-path", path)).code == 0


BIG = {
    **DENSE,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
}
"""128 KiB of bf16 KV per token (32 layers, 8 KV heads of 128): 16 tokens are 2 MiB of KV."""


def big_model(tmp_path: Path, **overrides: Any) -> Path:
    path = tmp_path / "big"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**BIG, **overrides}))
    return path


@pytest.mark.parametrize(
    ("args", "fits", "short"),
    [
        (["--kv-cache-dtype", "bf16"], "2052K", "2051K"),  # 16 tokens of 128 KiB, and a 4K header
        (["--kv-cache-dtype", "fp8_e4m3"], "1028K", "1027K"),
        ([], "516K", "515K"),  # auto: sglang may pick an fp4 cache, half a byte an element
        (["--kv-cache-dtype", "bf16", "--page-size", "64"], "8196K", "8195K"),  # 16 tokens are one page of 64
    ],
)
def test_a_capacity_below_one_extent_of_the_model_is_refused(
    tmp_path: Path, tier: Path, args: list[str], fits: str, short: str
) -> None:
    """The least extent an eviction writes: min_spill_tokens (16) in whole pages, of the model's KV."""
    model = ["--model-path", str(big_model(tmp_path))]
    line = refusal(run_main(spill(tier, *model, *args, "--hicache-spill-capacity", short)))
    assert line.startswith(f"--hicache-spill-capacity: {short} cannot hold one extent (at least {fits}: a 4K "
                           "header and the KV of "), line  # fmt: skip
    assert run_main(spill(tier, *model, *args, "--hicache-spill-capacity", fits)).code == 0
    assert not tier.exists()


def test_the_capacity_holds_one_extent_of_every_tp_rank(tmp_path: Path, tier: Path) -> None:
    """The TP ranks share the directory's budget and each writes its own extent of an evicted node:
    at TP 2 two least extents of one rank's KV (4 KV heads, 1028K each) or no node stays spilled."""
    model = ["--model-path", str(big_model(tmp_path)), "--kv-cache-dtype", "bf16", "--tp-size", "2"]
    line = refusal(run_main(spill(tier, *model, "--hicache-spill-capacity", "2055K")))
    assert line == ("--hicache-spill-capacity: 2055K cannot hold one extent for each of 2 TP ranks (at least 2056K: "
                    "2 × a 4K header and one rank's KV of 16 tokens, min_spill_tokens in whole pages, of this model), "
                    "so no node could be kept spilled on every rank; raise --hicache-spill-capacity"), line  # fmt: skip
    assert run_main(spill(tier, *model, "--hicache-spill-capacity", "2056K")).code == 0
    assert not tier.exists()


TP2_32_TOKENS = [
    "--kv-cache-dtype",
    "bf16",
    "--tp-size",
    "2",
    "--hicache-spill-extra-config",
    '{"min_spill_tokens": 32}',
]


@pytest.mark.parametrize(
    ("args", "fits", "short"),
    [
        (["--kv-cache-dtype", "bf16"], "2M", "2047K"),  # 16 tokens of 128 KiB, packed (no header)
        (TP2_32_TOKENS, "2M", "2047K"),  # staging is a rank's: 32 tokens of 4 KV heads, 64 KiB each
        (["--kv-cache-dtype", "bf16", "--page-size", "64"], "8M", "8191K"),  # 16 tokens are one page of 64
    ],
)
def test_a_staging_below_one_extent_of_the_model_is_refused(
    tmp_path: Path, tier: Path, args: list[str], fits: str, short: str
) -> None:
    """Staging holds an extent's packed KV while it is written and while it is read back: one
    smaller than the least extent an eviction writes could never spill anything."""
    model = ["--model-path", str(big_model(tmp_path)), *args]
    line = refusal(run_main(spill(tier, *model, "--hicache-spill-staging", short)))
    assert line.startswith(
        f"--hicache-spill-staging: {short} cannot hold one extent (at least {fits}: the KV of "
    ), line
    assert line.endswith("so nothing could spill; raise --hicache-spill-staging"), line
    assert run_main(spill(tier, *model, "--hicache-spill-staging", fits)).code == 0
    assert not tier.exists()


@pytest.mark.parametrize("tp", [1, 2])
def test_the_staging_of_every_tp_rank_beyond_this_machines_memory_is_refused(tier: Path, tp: int) -> None:
    """Each TP rank allocates its own staging at start: a server takes TP x the flag of host memory,
    and one byte more per rank than the machine holds is refused."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    over, fits = total // tp + 1, total // tp
    line = refusal(run_main(spill(tier, "--tp-size", str(tp), "--hicache-spill-staging", f"{over}B")))
    each = f" on each of 2 TP ranks ({human(2 * over)})" if tp == 2 else ""
    memory = f"is more than this machine's memory ({human(total)})"
    assert line == f"--hicache-spill-staging: {human(over)}{each} {memory}", line
    assert run_main(spill(tier, "--tp-size", str(tp), "--hicache-spill-staging", f"{fits}B")).code == 0
    assert not tier.exists()


def test_an_mla_model_and_min_spill_tokens_set_the_least_extent(tmp_path: Path, tier: Path) -> None:
    """MLA: one latent vector (512 + 64 rope) a layer, on every rank; 32 tokens of 2 bytes each, an
    extent on each of the 2 ranks."""
    model = ["--model-path", str(big_model(tmp_path, kv_lora_rank=512, qk_rope_head_dim=64)), "--kv-cache-dtype",
             "bf16", "--tp-size", "2", "--hicache-spill-extra-config", '{"min_spill_tokens": 32}']  # fmt: skip
    least = 2 * (32 * 32 * 576 * 2 + 4096)  # 2 x 1156K
    assert refusal(run_main(spill(tier, *model, "--hicache-spill-capacity", f"{least - 1}B")))
    assert run_main(spill(tier, *model, "--hicache-spill-capacity", f"{least}B")).code == 0


def test_without_a_readable_config_json_only_the_formats_floor_applies(tmp_path: Path, tier: Path) -> None:
    """A hub id (or an unreadable config.json): one header block and one block of KV, 8K."""
    line = refusal(run_main(spill(tier, "--hicache-spill-capacity", "8191B")))
    assert line == ("--hicache-spill-capacity: 8191 cannot hold one extent (at least 8K: a 4K header and a 4K "
                    "block of KV), so every store would be refused; raise --hicache-spill-capacity")  # fmt: skip
    assert run_main(spill(tier, "--hicache-spill-capacity", "8K")).code == 0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("swa", "a hybrid sliding-window (SWA) model (GptOssForCausalLM)"),
        ("swa_opt_in", "a hybrid sliding-window (SWA) model (LlamaForCausalLM)"),
        ("ssm", "a hybrid SSM / linear-attention model (Qwen3NextForCausalLM)"),
        ("ssm_layers", "a hybrid SSM / linear-attention model (GraniteMoeHybridForCausalLM)"),
        ("multimodal", "a multimodal model (LlavaForConditionalGeneration)"),
    ],
)
def test_models_our_backend_cannot_serve_are_refused_from_their_config_json(
    tmp_path: Path, tier: Path, name: str, message: str
) -> None:
    path = model_dir(tmp_path, name)
    line = refusal(run_main([*spill(tier)[2:], "--model-path", str(path)]))
    assert line == (f"--model-path {path}: {message} per its config.json; the hicache_spill backend "
                    "serves dense full-attention text models only"), line  # fmt: skip
    assert not tier.exists() and sorted(p.name for p in path.iterdir()) == ["config.json"]


@pytest.mark.parametrize(
    ("name", "args"),
    [("dense", []), ("swa", ["--disable-hybrid-swa-memory"]), ("multimodal", ["--language-model-only"]),
     ("mm_off_by_default", [])],
)  # fmt: skip
def test_models_sglang_serves_as_dense_text_pass(
    tmp_path: Path, tier: Path, name: str, args: list[str]
) -> None:
    run = run_main([*spill(tier)[2:], "--model-path", str(model_dir(tmp_path, name)), *args])
    assert run.code == 0 and run.stderr == "" and len(run.started) == 1


def test_an_unreadable_config_json_is_left_to_sglang(tmp_path: Path, tier: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    assert run_main([*spill(tier)[2:], "--model-path", str(tmp_path / "m")]).code == 0


def test_our_model_rules_agree_with_sglangs() -> None:
    """Every architecture we call hybrid SWA is one for sglang 0.5.23, and every model type we call
    recurrent is one of the configs sglang's `hybrid_arch` tests for recurrent state."""
    from types import SimpleNamespace

    import sglang.srt.configs.hybrid_arch as hybrid_arch
    from sglang.srt.configs.model_config import is_hybrid_swa_model
    from transformers import PretrainedConfig

    text = SimpleNamespace(layer_types=["sliding_attention", "full_attention"], sliding_window=128)
    assert all(is_hybrid_swa_model([arch], text) for arch in HYBRID_SWA_ARCHS)
    theirs = {
        cls.model_type
        for cls in vars(hybrid_arch).values()
        if isinstance(cls, type) and issubclass(cls, PretrainedConfig)
    }
    conditional = {"granitemoehybrid", "minicpm_sala", "inkling_model", "inkling_mm_model", "bailing_hybrid"}
    assert theirs - conditional <= SSM_MODEL_TYPES, theirs - conditional - SSM_MODEL_TYPES


def test_another_sglang_version_is_left_to_the_seam_check(tier: Path) -> None:
    """sglang's parser is read only where it is the one we know; otherwise the seam check refuses."""

    def seam() -> None:
        raise SeamError("sgl_hicache supports sglang 0.5.23 only; the installed sglang differs: version 9")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sglang_args.metadata, "version", lambda name: "9")
        mp.setattr(launch_server, "check_seam", seam)
        line = refusal(run_main(spill(tier, "--max-total-tokns", "1"), seam=False))
    assert line.startswith("sgl_hicache supports sglang 0.5.23 only")


def test_an_sglang_refusal_from_the_real_command(tier: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "sgl_hicache.launch_server", *spill(tier, "--enable-hierarchical-cache")],
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(PREFIX), result.stderr
    assert "--enable-hierarchical-cache: not supported" in lines[0] and not tier.exists()


def test_help_sglang_prints_sglangs_own_help() -> None:
    result = subprocess.run([sys.executable, "-m", "sgl_hicache.launch_server", "--help-sglang"],
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "--model-path" in result.stdout and "--enable-hierarchical-cache" in result.stdout
    assert "--hicache-spill-capacity" not in result.stdout


def test_a_volume_above_the_watermark_by_one_extent_of_the_model_is_enough(
    tmp_path: Path, small_volume: Path
) -> None:
    """A 64 MiB volume keeping 61M free has room for one 2052K extent; keeping 62M, not."""
    tier = small_volume / "tier"
    model = ["--model-path", str(big_model(tmp_path)), "--kv-cache-dtype", "bf16"]
    line = refusal(run_main(spill(tier, *model, "--hicache-spill-min-free", "62M")))
    assert line.startswith(f"--hicache-spill-min-free: the volume of {small_volume} holds 64M in all, not above "
                           "the 62M to keep free plus one extent (at least 2052K), so every store would be refused")  # fmt: skip
    assert run_main(spill(tier, *model, "--hicache-spill-min-free", "61M")).code == 0
    assert not tier.exists()


def test_the_volume_holds_one_extent_of_every_tp_rank_above_the_watermark(
    tmp_path: Path, small_volume: Path
) -> None:
    """At TP 2 a 64 MiB volume keeping 64000K free has room for one rank's 1028K extent, not for
    both ranks' (2056K); keeping 63480K, it has."""
    tier = small_volume / "tier"
    model = ["--model-path", str(big_model(tmp_path)), "--kv-cache-dtype", "bf16", "--tp-size", "2"]
    line = refusal(run_main(spill(tier, *model, "--hicache-spill-min-free", "64000K")))
    assert line == (f"--hicache-spill-min-free: the volume of {small_volume} holds 64M in all, not above the 64000K "
                    "to keep free plus one extent for each of 2 TP ranks (at least 2056K), so no node could be "
                    "kept spilled on every rank; lower --hicache-spill-min-free or use a larger volume"), line  # fmt: skip
    assert run_main(spill(tier, *model, "--hicache-spill-min-free", "63480K")).code == 0
    assert not tier.exists()


@pytest.mark.parametrize(
    ("disable", "mode", "message"),
    [(True, "null", "--disable-radix-cache: not supported"), (False, "prefill", "--disaggregation-mode prefill: "),
     (False, "decode", "--disaggregation-mode decode: ")],
)  # fmt: skip
def test_the_cache_factory_refuses_them_too(disable: bool, mode: str, message: str) -> None:
    """A server started without our launcher (`sglang.launch_server --radix-cache-backend
    hicache_spill`), or one where sglang resolved the radix cache off: the scheduler stops with the
    same line, before anything of ours is built."""
    from types import SimpleNamespace

    from sgl_hicache.config import ConfigError
    from sgl_hicache.server.factory import build_spill_cache

    ctx = SimpleNamespace(enable_hierarchical_cache=False, disable_radix_cache=disable,
                          server_args=SimpleNamespace(disaggregation_mode=mode))  # fmt: skip
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        build_spill_cache(ctx)  # type: ignore[arg-type]
