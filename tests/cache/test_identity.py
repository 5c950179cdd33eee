"""The KV namespace: every input that changes KV bytes splits it; parallelisms it cannot isolate are refused."""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sgl_hicache_kernels import KVKind, KVPoolView

from sgl_hicache.cache.identity import UNISOLATED, namespace_for, weights_fingerprint
from sgl_hicache.config import ConfigError
from sgl_hicache.launch_server import main, parse
from sgl_hicache.tier import Namespace

FIELDS = (
    "model_path", "revision", "download_dir", "dtype", "quantization", "kv_cache_dtype",
    "json_model_override_args", "model_impl", "load_format", "quantization_param_path", "modelopt_quant",
    "pp_size", "dp_size", "enable_dp_attention", "attn_dp_size", "dwdp_size", "attention_backend",
    "prefill_attention_backend", "decode_attention_backend", "device", "lora_paths",
)  # fmt: skip


@pytest.fixture(scope="module")
def defaults() -> dict[str, Any]:
    """The real sglang 0.5.23 ServerArgs defaults of every field the namespace reads."""
    from sglang.srt.server_args import ServerArgs

    real = ServerArgs(model_path="placeholder")
    return {name: getattr(real, name) for name in FIELDS}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model", torch.arange(64, dtype=torch.float32).view(8, 8))


@pytest.fixture
def make_ctx(defaults: dict[str, Any], model_dir: Path) -> Any:
    def make(tp_rank: int = 0, **args: Any) -> SimpleNamespace:
        server_args = SimpleNamespace(**{**defaults, "model_path": str(model_dir), **args})
        return SimpleNamespace(server_args=server_args, tp_rank=tp_rank, tp_size=2)

    return make


def write_model(root: Path, weight: torch.Tensor) -> Path:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    save_file({"layer.weight": weight.contiguous(), "layer.bias": torch.ones(8)}, root / "model.safetensors")
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}')
    return root


def pool_view(v_head_dim: int | None = None) -> KVPoolView:
    k = [torch.zeros(16, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.zeros(16, 2, v_head_dim or 8, dtype=torch.bfloat16) for _ in range(2)]
    layers = tuple(zip(k, v, strict=True))
    return KVPoolView(KVKind.MHA, layers, page_size=1, dtype=torch.bfloat16, heads=2, head_dim=8,
                      v_head_dim=v_head_dim)  # fmt: skip


def namespace(ctx: Any, view: KVPoolView | None = None) -> Namespace:
    return namespace_for(ctx, view or pool_view())


def test_fake_args_are_real_server_args_fields() -> None:
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    real = {f.name for f in record_fields(ServerArgs)}
    assert set(FIELDS) <= real
    assert {entry.field for entry in UNISOLATED} <= real


def test_refused_spellings_are_sglang_flags() -> None:
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for entry in UNISOLATED:
        for flag in entry.flags:
            args, unknown = parser.parse_known_args(
                ["--model-path", "m", flag, *([] if entry.boolean else ["2"])]
            )
            assert unknown == [] and getattr(args, entry.field) == (True if entry.boolean else 2), flag


def test_identical_inputs_give_the_same_namespace(make_ctx: Any) -> None:
    assert namespace(make_ctx()).id == namespace(make_ctx()).id
    assert namespace(make_ctx(dtype="bfloat16")).id == namespace(make_ctx(dtype="bfloat16")).id


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "bfloat16"},
        {"dtype": "float16"},
        {"quantization": "fp8"},
        {"kv_cache_dtype": "fp8_e4m3"},
        {"json_model_override_args": '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}'},
        {"model_impl": "transformers"},
        {"revision": "v2"},
        {"load_format": "dummy"},
        {"quantization_param_path": "/scales/kv.json"},
        {"modelopt_quant": "fp8"},
        {"attention_backend": "triton"},
        {"decode_attention_backend": "flashinfer"},
        {"device": "cuda"},
        {"lora_paths": ["adapter=/loras/a"]},
        {"tp_rank": 1},
    ],
    ids=lambda change: "-".join(f"{k}={v}" for k, v in change.items())[:40],
)
def test_each_kv_input_splits_the_namespace(make_ctx: Any, change: dict[str, Any]) -> None:
    assert namespace(make_ctx(**change)).id != namespace(make_ctx()).id


def test_pool_shape_beyond_the_layout_splits_the_namespace(make_ctx: Any) -> None:
    assert namespace(make_ctx(), pool_view(v_head_dim=4)).id != namespace(make_ctx(), pool_view()).id


def test_resolved_values_count_not_only_the_flags(make_ctx: Any) -> None:
    """A value sglang's resolution declared (e.g. kv_cache_dtype picked for the platform) splits too."""
    plain, resolved = make_ctx(), make_ctx()
    resolved.server_args._resolved_overrides = [("some_hook", {"kv_cache_dtype": "fp8_e4m3"})]
    assert namespace(resolved).id != namespace(plain).id
    assert namespace(resolved).id == namespace(make_ctx(kv_cache_dtype="fp8_e4m3")).id


def test_json_override_spelling_does_not_split_the_namespace(make_ctx: Any) -> None:
    a = make_ctx(json_model_override_args='{"a": 1, "b": {"c": 2}}')
    b = make_ctx(json_model_override_args='{ "b": {"c":2},"a":1 }')
    assert namespace(a).id == namespace(b).id


def test_rewritten_weights_split_the_namespace(make_ctx: Any, model_dir: Path) -> None:
    before = namespace(make_ctx()).id
    weight = torch.arange(64, dtype=torch.float32).view(8, 8)
    weight[3, 5] = -1.0
    write_model(model_dir, weight)
    assert namespace(make_ctx()).id != before


def write_adapter(root: Path, scale: float) -> Path:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    save_file({"lora_A.weight": torch.full((4, 8), scale)}, root / "adapter_model.safetensors")
    (root / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    return root


@pytest.mark.parametrize("spelling", ["string", "dict", "LoRARef"])
def test_a_lora_adapter_retrained_in_place_splits_the_namespace(
    make_ctx: Any, tmp_path: Path, spelling: str
) -> None:
    from sglang.srt.lora.lora_registry import LoRARef

    adapter = write_adapter(tmp_path / "adapter", 1.0)
    entry = {"string": f"a={adapter}", "dict": {"lora_name": "a", "lora_path": str(adapter)},
             "LoRARef": LoRARef(lora_id="x", lora_name="a", lora_path=str(adapter))}[spelling]  # fmt: skip
    before = namespace(make_ctx(lora_paths=[entry])).id
    assert namespace(make_ctx(lora_paths=[entry])).id == before
    write_adapter(adapter, 0.5)  # same name, same path, same shapes: other weights
    assert namespace(make_ctx(lora_paths=[entry])).id != before
    write_adapter(adapter, 1.0)
    (adapter / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 16}')
    assert namespace(make_ctx(lora_paths=[entry])).id != before


def test_fingerprint_sees_a_rewrite_in_place_and_not_a_copy(tmp_path: Path, model_dir: Path) -> None:
    original = weights_fingerprint(str(model_dir), None)
    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(model_dir, copy)
    assert weights_fingerprint(str(copy), None) == original
    weight = torch.arange(64, dtype=torch.float32).view(8, 8)
    weight[7, 7] = 0.5  # same shapes, same header, one value
    write_model(copy, weight)
    assert weights_fingerprint(str(copy), None) != original
    write_model(copy, torch.arange(64, dtype=torch.float32).view(8, 8))
    assert weights_fingerprint(str(copy), None) == original, "restored weights give back the fingerprint"
    (copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3}')
    assert weights_fingerprint(str(copy), None) != original


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_fingerprint_samples_start_middle_and_end_of_a_large_file(tmp_path: Path, where: float) -> None:
    n = 256 * 1024  # 1 MiB of fp32: far more than the three 64 KiB samples
    root = write_model(tmp_path / "big", torch.zeros(n))
    before = weights_fingerprint(str(root), None)
    weight = torch.zeros(n)
    weight[min(int(where * n), n - 1)] = 1.0
    write_model(root, weight)
    assert weights_fingerprint(str(root), None) != before


def test_fingerprint_ignores_files_sglang_does_not_load(model_dir: Path) -> None:
    before = weights_fingerprint(str(model_dir), None)
    (model_dir / "presharded").mkdir()
    (model_dir / "presharded" / "rank0.safetensors").write_bytes(b"written by a later run")
    (model_dir / "README.md").write_text("notes")
    assert weights_fingerprint(str(model_dir), None) == before


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the fingerprint tried the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.usefixtures("no_network")
def test_uncached_hub_id_falls_back_offline_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = str(tmp_path / "hf-cache")
    with caplog.at_level(logging.WARNING, logger="sgl_hicache.cache.identity"):
        a = weights_fingerprint("sgl-hicache-test/not-cached", "main", cache_dir=cache)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "will not be detected" in warnings[0].getMessage()
    assert a == weights_fingerprint("sgl-hicache-test/not-cached", "main", cache_dir=cache)
    assert a != weights_fingerprint("sgl-hicache-test/not-cached", "v2", cache_dir=cache)


@pytest.mark.usefixtures("no_network")
def test_cached_hub_id_is_fingerprinted_from_its_local_snapshot(tmp_path: Path, model_dir: Path) -> None:
    repo = tmp_path / "hf-cache" / "models--org--tiny"
    sha = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    got = weights_fingerprint("org/tiny", None, cache_dir=str(tmp_path / "hf-cache"))
    assert got == weights_fingerprint(str(model_dir), None)


@pytest.mark.usefixtures("no_network")
def test_namespace_of_a_hub_id_looks_in_the_download_dir(make_ctx: Any, tmp_path: Path) -> None:
    ctx = make_ctx(model_path="sgl-hicache-test/not-cached", download_dir=str(tmp_path / "dl"))
    assert namespace(ctx).id == namespace(ctx).id


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ({"pp_size": 2}, "--pp-size"),
        ({"dp_size": 2}, "--dp-size"),
        ({"enable_dp_attention": True, "dp_size": 2}, "--enable-dp-attention"),
        ({"attn_dp_size": 2}, "--attn-dp-size"),
        ({"dwdp_size": 2}, "--dwdp-size"),
    ],
)
def test_unisolated_parallelism_is_refused(make_ctx: Any, args: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError, match=f"^{flag}: not supported with the hicache_spill backend") as e:
        namespace(make_ctx(**args))
    assert "\n" not in str(e.value)


def test_parallelism_declared_by_resolution_is_refused(make_ctx: Any) -> None:
    ctx = make_ctx()
    ctx.server_args._resolved_overrides = [("_handle_dwdp", {"attn_dp_size": 4, "dp_size": 1})]
    with pytest.raises(ConfigError, match="--attn-dp-size"):
        namespace(ctx)


SPILL = ["--model-path", "m", "--enable-hicache-spill"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--pp-size", "2"], "--pp-size"),
        (["--pipeline-parallel-size=4"], "--pp-size"),
        (["--dp-size", "2"], "--dp-size"),
        (["--data-parallel-size=2"], "--dp-size"),
        (["--tp-size", "2", "--enable-dp-attention"], "--enable-dp-attention"),
        (["--dp-size", "2", "--enable-dp-attention"], "--enable-dp-attention"),
        (["--attn-dp-size", "2"], "--attn-dp-size"),
        (["--dwdp-size", "2"], "--dwdp-size"),
    ],
)
def test_launcher_refuses_unisolated_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    args = [*SPILL, "--hicache-spill-dir", str(tmp_path / "t"), *argv]
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        parse(args)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m sgl_hicache.launch_server: error: {flag}: ")


def test_launcher_accepts_width_one_and_spill_off(tmp_path: Path) -> None:
    parse(
        [
            *SPILL,
            "--hicache-spill-dir",
            str(tmp_path / "t"),
            "--pp-size",
            "1",
            "--dp-size=1",
            "--tp-size",
            "2",
        ]
    )
    _, rest = parse(["--model-path", "m", "--pp-size", "2", "--enable-dp-attention"])
    assert rest == ["--model-path", "m", "--pp-size", "2", "--enable-dp-attention"]
