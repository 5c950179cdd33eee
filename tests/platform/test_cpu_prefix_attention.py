"""The CPU benchmarks' extend attention (`sgl_hicache_cpu.cpu_prefix_attention`) against
sglang's own `_run_sdpa_forward_extend`, which pads each query to the whole sequence."""

from __future__ import annotations

import pytest
import torch
from sgl_hicache_cpu import cpu_prefix_attention as patch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

ORIGINAL = TorchNativeAttnBackend._run_sdpa_forward_extend


def batch(seqs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, seed: int = 0) -> dict:
    """Requests of (cached prefix, new tokens) in a pool whose slots are shuffled."""
    g = torch.Generator().manual_seed(seed)
    total = sum(p + n for p, n in seqs)
    slots = torch.randperm(total + 7, generator=g)[:total]
    req_to_token = torch.zeros(len(seqs), max(p + n for p, n in seqs), dtype=torch.int64)
    at = 0
    for i, (p, n) in enumerate(seqs):
        req_to_token[i, : p + n] = slots[at : at + p + n]
        at += p + n
    new = sum(n for _, n in seqs)
    return dict(
        query=torch.randn(new, heads, dim, generator=g),
        k_cache=torch.randn(total + 7, kv_heads, dim, generator=g),
        v_cache=torch.randn(total + 7, kv_heads, dim, generator=g),
        req_to_token=req_to_token,
        req_pool_indices=torch.arange(len(seqs)),
        seq_lens=torch.tensor([p + n for p, n in seqs]),
        extend_prefix_lens=torch.tensor([p for p, _ in seqs]),
        extend_seq_lens=torch.tensor([n for _, n in seqs]),
    )


def run(fn, b: dict, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.zeros_like(b["query"])
    args = [b[k] for k in ("k_cache", "v_cache", "req_to_token", "req_pool_indices", "seq_lens",
                           "extend_prefix_lens", "extend_seq_lens")]  # fmt: skip
    return fn(None, b["query"], out, *args, **kw)


@pytest.mark.parametrize(
    "seqs", [[(0, 5)], [(64, 1)], [(37, 11)], [(0, 3), (100, 20), (7, 1)], [(255, 33), (1, 1)]]
)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_new_rows_see_what_the_padded_query_sees(
    seqs: list[tuple[int, int]], heads: int, kv_heads: int
) -> None:
    b = batch(seqs, heads, kv_heads, dim=16, seed=len(seqs) + heads)
    kw = dict(scaling=0.25, enable_gqa=heads != kv_heads, causal=True)
    want = run(ORIGINAL, b, **kw)
    got = run(patch._patched(ORIGINAL), b, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_wrong_mask_would_be_caught() -> None:
    """The comparison above can fail: top-left causal (SDPA's is_causal with fewer rows) differs."""
    b = batch([(40, 8)], 4, 4, dim=16)
    want = run(ORIGINAL, b, scaling=None, enable_gqa=False, causal=True)
    q = b["query"].movedim(0, 1)
    tokens = b["req_to_token"][0, :48]
    k, v = b["k_cache"][tokens].movedim(0, 1), b["v_cache"][tokens].movedim(0, 1)
    wrong = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)
    assert not torch.allclose(wrong[0].movedim(1, 0), want, atol=1e-3)


def test_other_cases_go_to_the_original() -> None:
    calls: list[bool] = []

    def original(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(True)
        return args[1]

    b = batch([(4, 4)], 2, 2, dim=8)
    patched = patch._patched(original)
    run(patched, b, scaling=None, enable_gqa=False, causal=False)
    run(patched, b, scaling=None, enable_gqa=False, causal=True, sliding_window_size=8)
    assert calls == [True, True]
    run(patched, b, scaling=None, enable_gqa=False, causal=True, sliding_window_size=-1)
    assert calls == [True, True]


def test_apply_is_idempotent_and_marks_the_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TorchNativeAttnBackend, "_run_sdpa_forward_extend", ORIGINAL)
    assert patch.apply()
    first = TorchNativeAttnBackend._run_sdpa_forward_extend
    assert first is not ORIGINAL
    assert patch.apply()
    assert TorchNativeAttnBackend._run_sdpa_forward_extend is first


def test_a_missing_target_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patch, "MODULE", "sglang.srt.layers.attention.no_such_backend")
    with pytest.raises(patch.PrefixAttentionTargetMissing, match="no_such_backend"):
        patch.apply()


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("0", False), ("", False)])
def test_env(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.delenv(patch.ENV_VAR_SGLANG_TWIN, raising=False)
    monkeypatch.setenv(patch.ENV_VAR, value)
    assert patch.enabled_by_env() is on
