"""GB/s of pack_kv / unpack_kv vs a plain-torch reference and vs a plain copy of the same bytes.

    python -m benchmarks.kernels                      # CPU-sized defaults, on the device at hand
    python -m benchmarks.kernels --preset llama8b     # 32 layers, 8 KV heads, head_dim 128, bf16, 4k tokens

Runs on CUDA/ROCm when present (the Triton path), else on CPU (the torch path). Each configuration
first checks the API's bytes against the reference with torch.equal, then times pack, unpack,
reference pack/unpack, a device copy of the same number of bytes and a plain gather of the same rows
(per buffer, `index_select` into a contiguous buffer: what any row gather costs, before our layout),
interleaved round by round (best of rounds). The headline figures are page_size 1 with uniformly
scattered slots (token-granular), the worst case: sglang's page_size-1 allocator hands a prefill a
run of its FIFO free list (one run on a fresh pool) and a decode step one slot per running request,
so real slots are runs and ascending strides. `_runs` uses shuffled runs of `--runs` slots, `_run1`
all slots as one run (a node filled by one prefill), `_p{N}` whole shuffled pages (page-granular).
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from sgl_hicache_kernels import KVKind, KVPoolView, pack_kv, packed_nbytes, unpack_kv

from benchmarks.harness import emit, gbps, log

PRESETS = {
    "cpu": dict(layers=8, heads=8, head_dim=128, tokens=2048),
    "llama8b": dict(layers=32, heads=8, head_dim=128, tokens=4096),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def make_pool(args: argparse.Namespace, page_size: int, device: torch.device) -> KVPoolView:
    dtype = DTYPES[args.dtype]
    store = torch.uint8 if dtype.itemsize == 1 else dtype
    slots = 2 * args.tokens + page_size

    def buf() -> torch.Tensor:
        shape = (slots, args.heads, args.head_dim * dtype.itemsize)
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(store)

    layers = tuple((buf(), buf()) for _ in range(args.layers))
    return KVPoolView(KVKind.MHA, layers, page_size, dtype, args.heads, args.head_dim)


def make_slots(view: KVPoolView, n: int, runs: int = 0) -> torch.Tensor:
    """Scattered slots (page_size 1), shuffled whole pages (page_size > 1), or with runs > 0
    shuffled runs of that many consecutive slots (what sglang's allocator hands one request);
    runs >= n: one run at a random offset."""
    ps = view.page_size
    if runs >= n:
        return torch.arange(n).add_(int(torch.randint(0, view.num_slots - n + 1, ()))).to(view.device)
    if runs:
        chunks = torch.arange(view.num_slots // runs * runs).view(-1, runs)
        return chunks[torch.randperm(chunks.shape[0])].flatten()[:n].to(view.device)
    if ps == 1:
        return torch.randperm(view.num_slots)[:n].to(view.device)
    pages = torch.randperm(view.num_slots // ps)[: n // ps]
    return (pages[:, None] * ps + torch.arange(ps)).flatten().to(view.device)


def ref_pack(view: KVPoolView, slots: torch.Tensor) -> torch.Tensor:
    """The obvious plain-torch pack: gather each buffer, then interleave into page-major order."""
    rows = [b.view(torch.uint8).view(view.num_slots, -1) for b in view.buffers]
    pages = slots.numel() // view.page_size
    gathered = [r.index_select(0, slots).view(pages, -1) for r in rows]
    return torch.cat(gathered, dim=1).view(-1)


def ref_unpack(view: KVPoolView, slots: torch.Tensor, packed: torch.Tensor) -> None:
    """The obvious plain-torch unpack: per buffer, an indexed assignment from its strided blocks."""
    rows = [b.view(torch.uint8).view(view.num_slots, -1) for b in view.buffers]
    pages = packed.view(slots.numel() // view.page_size, -1)
    for r, off in zip(rows, view.block_offsets, strict=True):
        block = pages[:, off : off + view.page_size * r.shape[1]]
        r[slots] = block.reshape(-1, r.shape[1])


def check(view: KVPoolView, slots: torch.Tensor, backend: str) -> bool:
    out = torch.empty(packed_nbytes(view, slots.numel()), dtype=torch.uint8, device=view.device)
    pack_kv(view, slots, out, backend=backend)  # type: ignore[arg-type]
    ok = torch.equal(out, ref_pack(view, slots))
    before = [b.clone() for b in view.buffers]
    for b in view.buffers:
        b.view(torch.uint8)[slots] = 0
    unpack_kv(view, slots, out, backend=backend)  # type: ignore[arg-type]
    return ok and all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(before, view.buffers, strict=True)
    )


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def measure(view: KVPoolView, n: int, backend: str, rounds: int, runs: int = 0) -> dict[str, float]:
    slots = make_slots(view, n, runs)
    nbytes = packed_nbytes(view, n)
    out = torch.empty(nbytes, dtype=torch.uint8, device=view.device)
    src, dst = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=view.device), torch.empty_like(out)
    rows = [b.view(torch.uint8).view(view.num_slots, -1) for b in view.buffers]
    gathered = [dst[i * n * r.shape[1] :][: n * r.shape[1]].view(n, -1) for i, r in enumerate(rows)]
    ops: dict[str, Callable[[], Any]] = {
        "pack": lambda: pack_kv(view, slots, out, backend=backend),  # type: ignore[arg-type]
        "unpack": lambda: unpack_kv(view, slots, out, backend=backend),  # type: ignore[arg-type]
        "ref_pack": lambda: ref_pack(view, slots),
        "ref_unpack": lambda: ref_unpack(view, slots, out),
        "copy": lambda: dst.copy_(src),
        "gather": lambda: [
            torch.index_select(r, 0, slots, out=g) for r, g in zip(rows, gathered, strict=True)
        ],
    }
    best = {name: float("inf") for name in ops}
    for _ in range(rounds + 1):  # the first round warms up (Triton compiles, pages fault in)
        for name, fn in ops.items():
            best[name] = min(best[name], timed(fn, view.device))
    return {name: gbps(nbytes, t) for name, t in best.items()}


def sweep(view: KVPoolView, n: int, rounds: int) -> dict[str, Any]:
    """Time the Triton kernels over launch configs (block bytes x group; warps follow the block)."""
    from sgl_hicache_kernels.pack_triton import LaunchConfig, pack_kv_triton, unpack_kv_triton
    from sgl_hicache_kernels.plan import plan_copy

    slots = make_slots(view, n)
    out = torch.empty(packed_nbytes(view, n), dtype=torch.uint8, device=view.device)
    plan = plan_copy(view, slots, out, scatter=False)
    expected = ref_pack(view, slots)
    rows = []
    for block_bytes in (2048, 8192, 16384):
        for group in (1, 4, 16):
            cfg = LaunchConfig(block_bytes, min(8, block_bytes // 512), group)
            out.zero_()
            pack_kv_triton(view, slots, out, plan, cfg)
            if not torch.equal(out, expected):
                raise AssertionError(f"{cfg} packed wrong bytes")
            times = {
                op: min(timed(fn, view.device) for _ in range(rounds + 1))
                for op, fn in (
                    ("pack", lambda cfg=cfg: pack_kv_triton(view, slots, out, plan, cfg)),
                    ("unpack", lambda cfg=cfg: unpack_kv_triton(view, slots, out, plan, cfg)),
                )
            }
            rows.append((cfg, gbps(out.numel(), times["pack"]), gbps(out.numel(), times["unpack"])))
            log(
                f"  sweep page_size {view.page_size} {cfg}: pack {rows[-1][1]:.1f} GB/s, unpack {rows[-1][2]:.1f} GB/s"
            )
    cfg, pack, unpack = max(rows, key=lambda r: r[1] + r[2])
    tag = f"block={cfg.block_bytes},warps={cfg.num_warps},group={cfg.group}"
    return {"best_config": tag, "best_pack": pack, "best_unpack": unpack}


def run_config(args: argparse.Namespace, page_size: int, device: torch.device) -> dict[str, Any]:
    view = make_pool(args, page_size, device)
    n = args.tokens // page_size * page_size
    correct = check(view, make_slots(view, n), args.backend)
    figures = measure(view, n, args.backend, args.rounds)
    log(
        f"page_size {page_size}: {packed_nbytes(view, n) / 2**20:.0f} MiB, correct={correct}  "
        + "  ".join(f"{k} {v:.2f} GB/s" for k, v in figures.items())
    )
    if page_size == 1 and args.runs:
        correct = correct and check(view, make_slots(view, n, args.runs), args.backend)
        in_runs = measure(view, n, args.backend, args.rounds, args.runs)
        log(
            f"page_size 1, runs of {args.runs}: pack {in_runs['pack']:.2f}, unpack {in_runs['unpack']:.2f} GB/s"
        )
        figures |= {f"{k}_runs": v for k, v in in_runs.items()}
        correct = correct and check(view, make_slots(view, n, n), args.backend)
        one_run = measure(view, n, args.backend, args.rounds, n)
        log(f"page_size 1, one run: pack {one_run['pack']:.2f}, unpack {one_run['unpack']:.2f} GB/s")
        figures |= {f"{k}_run1": v for k, v in one_run.items()}
    if args.sweep:
        figures |= sweep(view, n, args.rounds)
    return {"correct": correct, **figures}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--tokens", type=int)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--page-sizes", default="1,64", help="comma list; the first gives the headline figures")
    p.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--runs", type=int, default=256, help="page_size 1: also time runs of this many slots (0: skip)"
    )
    p.add_argument("--sweep", action="store_true", help="also time Triton launch configs (GPU tuning)")
    args = p.parse_args()
    if args.sweep and args.backend == "torch":
        p.error("--sweep times the Triton kernels")
    preset = PRESETS[args.preset or ("llama8b" if torch.cuda.is_available() else "cpu")]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu x{torch.get_num_threads()} threads"
    )
    log(
        f"{name}: {args.layers} layers x {args.heads} heads x {args.head_dim} {args.dtype}, {args.tokens} tokens"
    )
    page_sizes = [int(s) for s in args.page_sizes.split(",")]
    results = {ps: run_config(args, ps, device) for ps in page_sizes}
    head = results[page_sizes[0]]
    figures: dict[str, Any] = {
        "device": name,
        "backend": args.backend,
        "shape": f"{args.layers}x{args.heads}x{args.head_dim} {args.dtype} {args.tokens} tok",
        "correct": all(r["correct"] for r in results.values()),
        "pack_gbps": head["pack"],
        "unpack_gbps": head["unpack"],
        "copy_gbps": head["copy"],
        "pack_vs_copy": head["pack"] / head["copy"],
        "unpack_vs_copy": head["unpack"] / head["copy"],
        "pack_vs_ref": head["pack"] / head["ref_pack"],
        "unpack_vs_ref": head["unpack"] / head["ref_unpack"],
        "gather_vs_copy": head["gather"] / head["copy"],
        "pack_vs_gather": head["pack"] / head["gather"],
    }
    for ps in page_sizes[1:]:
        r = results[ps]
        figures |= {
            f"pack_gbps_p{ps}": r["pack"],
            f"unpack_gbps_p{ps}": r["unpack"],
            f"pack_vs_copy_p{ps}": r["pack"] / r["copy"],
            f"unpack_vs_copy_p{ps}": r["unpack"] / r["copy"],
        }
    if "pack_runs" in head:
        figures |= {
            "pack_vs_copy_runs": head["pack_runs"] / head["copy_runs"],
            "unpack_vs_copy_runs": head["unpack_runs"] / head["copy_runs"],
            "pack_vs_copy_run1": head["pack_run1"] / head["copy_run1"],
            "unpack_vs_copy_run1": head["unpack_run1"] / head["copy_run1"],
        }
    if args.sweep:
        for ps, r in results.items():
            figures |= {f"{k}_p{ps}": r[k] for k in ("best_config", "best_pack", "best_unpack")}
    emit(figures)
    if not figures["correct"]:
        raise SystemExit("pack/unpack bytes differ from the reference")


if __name__ == "__main__":
    main()
