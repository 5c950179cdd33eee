"""A long conversation pushed out of device *and* host memory, then resumed: where a tier must win.

    python -m benchmarks.long_history [--model kvheavy] [--lengths 8192,16384] [--systems ...]
                                      [--new-tokens 0,256,1024,4096] [--rounds 2] [--repeats 2]
                                      [--dir out/bench-long]

For each system (recompute: sglang's default cache; HiCache configurations of
`benchmarks.bench.spec.HICACHE_CONFIGS`, `file` L3 on the same disk; LMCache configurations of
`LMCACHE_CONFIGS`, its L1 the host budget, its disk tier on the same disk, each server beside its own
LMCache daemon; ours; ours-layerwise: ours with `--hicache-spill-layerwise`, its prefill starting
once the first layer group of the restore landed; by default the peers' strongest configurations,
`spec.DEFAULT_SYSTEMS`) and each history length L and new-token count n (`--new-tokens`, default
one question of 96 tokens):

  1. history: a prompt of L tokens is served (the conversation so far);
  2. resident: n new tokens on it while it is still in the device pool (`resident_ms`: the
     floor any cache is compared with, measured on every server after every resume too, once
     the resume's own writes are done, as the resume is timed after the other work's);
  3. other work: unrelated short prompts of more tokens than the device pool and the host pool
     (HiCache's, LMCache's L1) together, so the history is in neither; once their writes are done, the tier's files
     are dropped from the page cache (fadvise: the servers' own code stays cached, else the
     timed request would pay page faults in torch);
  4. resume: the history + n new tokens; TTFT (`resume_ms`, one output token) and cached tokens.

Figures are keyed by L (`..._8192`) for the default question, by L and n (`..._8192_n256`)
otherwise. For ours and ours-layerwise, `<system>_hidden_share_<key>`: the share of the restore's
read time (`restore_read_seconds`) that did not add to the resumed TTFT over the resident one,
1 - (resume - resident) / read, clamped to [0, 1]; `<system>_vs_resident_<key>`: resume / resident
(issue 37's targets: ours-layerwise <= 1.15 at 256 new tokens, <= 1.05 at 4,096, and at 0 no slower
than ours).

Steps 3-4 run `--repeats` times per server; each system runs once per round, systems in a new
order every round (forward, then reversed): `--rounds` rounds. Figures are medians with their
min-max spread. For ours, the growth of our counters over each resume gives the phases of its TTFT
(`restore_wait_seconds`: admission waiting for reads; `restore_read_seconds`: first read starting
to last completing, verification included; `restore_unpack_seconds`; `lookup_seconds`), and after
each round the tier's raw parallel read bandwidth is measured on the same files (O_DIRECT, the
tier's I/O threads, page cache dropped), so restore time can be set against what the disk can do.

On CPU every server runs with `SGL_HICACHE_CPU_PREFIX_ATTENTION=1`
(`sgl_hicache_cpu.cpu_prefix_attention`): a turn's attention costs new tokens x history, as
on a GPU, instead of sglang's CPU backend recomputing the whole sequence. The default model is the
generated `kvheavy` (128 KiB of KV per token, like an 8B model; little compute): it stands for the
tier's work on an 8B model, not for its answers or its prefill time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.bench import pagecache
from benchmarks.bench.disk_speed import measured_shape
from benchmarks.bench.probe import dir_bytes, spill_state
from benchmarks.bench.report import replaced_whole
from benchmarks.bench.run import resolve_model, vocab_size
from benchmarks.bench.spec import DEFAULT_SYSTEMS as BENCH_DEFAULTS
from benchmarks.bench.spec import (
    FAMILIES,
    HICACHE,
    LMCACHE,
    LONG_HISTORY_TARGETS,
    Shape,
    SpecError,
    expand_systems,
)
from benchmarks.bench.systems import System, build, check_hicache_holds, host_tokens, kv_bytes_per_token
from benchmarks.bench.workload import token_ids
from benchmarks.harness import emit, gbps, log
from benchmarks.resume import naming_log, spill_counters, ttft
from sgl_hicache.config import TierConfig
from sgl_hicache.tier.directio import O_DIRECT, alloc_aligned

QUESTION = 96  # a new user message of 1.5 pages at page 64: the turn runs past the tree (a lookup)
FILLER = 512  # tokens per unrelated prompt: cheap to prefill, many of them fill the pools
HISTORY_SEED, FILLER_SEED = 10**9, 2 * 10**9  # token-id seeds of histories and other work, apart from
# each other and from the questions' (< 10**4), so no prompt of one kind starts another's
PHASES = (
    "restore_wait_seconds",
    "restore_read_seconds",
    "restore_unpack_seconds",
    "lookup_seconds",
    "spill_pack_seconds",
    "layerwise_wait_seconds",  # ours-layerwise: forwards waiting for layer groups (restore not hidden)
)
OURS = ("ours", "ours-layerwise")
SYSTEMS = ("recompute", *HICACHE, *LMCACHE, *OURS)
DEFAULT_SYSTEMS = tuple(s for s in BENCH_DEFAULTS if s in SYSTEMS)  # the benchmark's, less `resident`


def filler_tokens(system: System, shape: Shape, model: Path) -> int:
    """Unrelated tokens that push a history out of the device pool and the host pool (HiCache's, or
    LMCache's L1: the host budget)."""
    host = 0
    if system.name in LMCACHE:
        host = shape.host_budget_mb * 2**20 // kv_bytes_per_token(model)
    if system.name in HICACHE:
        config = HICACHE[system.name]
        host = host_tokens(config.host, config.default_ratio, shape, model)
    return shape.pool_tokens + host + shape.pool_tokens // 2


def filler_seed(round_: int, rep: int, length: int, new_tokens: int) -> int:
    """A seed of its own for each cell's other work: a prompt sent before would be found in a tier
    instead of prefilled, and the cells' tiers would hold different things."""
    return ((round_ * 1_000 + rep) * 1_000_003 + length) * 100_003 + new_tokens


def other_work(base: str, tokens: int, seed: int, vocab: int) -> None:
    prompts = [token_ids(FILLER_SEED + seed * 10_000 + i, FILLER, vocab) for i in range(-(-tokens // FILLER))]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda ids: ttft(base, ids), prompts))


def phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {p: after.get(f"{p}_total", 0.0) - before.get(f"{p}_total", 0.0) for p in PHASES} | {
        "restored_bytes": after.get("restored_bytes_total", 0.0) - before.get("restored_bytes_total", 0.0)
    }


def run_server(system: System, shape: Shape, model: Path, lengths: list[int], repeats: int,
               round_: int, workdir: Path, new_tokens: tuple[int, ...] = (QUESTION,)) -> list[dict[str, Any]]:  # fmt: skip
    """Every measurement of one system in one round, as rows."""
    rows: list[dict[str, Any]] = []
    log_path = workdir / f"{system.name}-r{round_}.log"
    vocab = vocab_size(model)
    ours = system.name in OURS

    def seq(seed: int, n: int) -> list[int]:  # ids within the model's vocabulary (tiny: 1,024)
        return token_ids(seed, n, vocab)

    with system.server(model, log_path).start(timeout_s=600) as server, naming_log(log_path):
        base = server.base_url
        for length in lengths:
            history = seq(HISTORY_SEED + round_ * 100_000 + length, length)
            ttft(base, history)
            for n in new_tokens:
                ttft(base, history + seq(7 + n, n))
                for rep in range(repeats):
                    other_work(
                        base, filler_tokens(system, shape, model), filler_seed(round_, rep, length, n), vocab
                    )
                    settle(system, base)
                    pagecache.drop([d for d in [system.tier_dir] if d is not None], whole_cache=False)
                    before = spill_counters(base) if ours else {}
                    ms, cached = ttft(base, history + seq(1000 + rep + 10 * n, n))
                    after = spill_counters(base) if ours else {}
                    settle(system, base)  # the resume's new tokens written back: no write beside it either
                    resident_ms, _ = ttft(base, history + seq(2000 + rep + 10 * n, n))
                    row = dict(system=system.name, round=round_, rep=rep, length=length, new_tokens=n,
                               resume_ms=ms, cached=cached, resident_ms=resident_ms, **phases(before, after))  # fmt: skip
                    rows.append(row)
                    log(f"r{round_} {system.name:>22} L={length:>6} n={n:>5}: resume {ms:9.1f} ms (cached {cached}), "
                        f"resident {resident_ms:8.1f} ms" + (f", phases {_fmt(row)}" if before else ""))  # fmt: skip
    return rows


def key(length: int, new_tokens: int) -> str:
    """A figure's suffix: the history length, and the new tokens unless the default question."""
    return f"{length}" if new_tokens == QUESTION else f"{length}_n{new_tokens}"


def _short(phase: str) -> str:
    """`restore_wait_seconds` -> `wait`, `spill_pack_seconds` -> `pack`, `lookup_seconds` -> `lookup`."""
    return phase.removesuffix("_seconds").removeprefix("restore_").removeprefix("spill_")


def _fmt(row: dict[str, Any]) -> str:
    return " ".join(f"{_short(p)}={row[p] * 1e3:.0f}ms" for p in PHASES)


def settle(system: System, base: str, timeout_s: float = 300.0) -> None:
    """Wait until the other work's writes are done (ours: none in flight; any system: its tier
    directory stopped growing for 2 s), so a resume is timed beside no background write."""
    deadline, last, still = time.monotonic() + timeout_s, -1, 0
    while time.monotonic() < deadline and still < 2:
        time.sleep(1.0)
        busy = system.name in OURS and spill_state(base).get("writes_in_flight", 0) > 0
        size = dir_bytes(system.tier_dir)
        still = 0 if busy or size != last else still + 1
        last = size


def raw_read_gbps(root: Path, threads: int, request: int = 4 << 20) -> tuple[float, int]:
    """Cold parallel O_DIRECT reads of every extent file under `root` (GB/s, bytes)."""
    files = [p for p in root.rglob("*") if p.is_file() and p.stat().st_size >= 1 << 20]
    pagecache.drop([root], whole_cache=False)
    bufs = [alloc_aligned(request) for _ in range(threads)]

    def read(i: int) -> int:
        total, buf = 0, bufs[i]
        for path in files[i::threads]:
            fd = os.open(path, os.O_RDONLY | O_DIRECT)
            try:
                off = 0
                while (n := os.preadv(fd, [buf], off)) > 0:
                    off += n
                total += off
            finally:
                os.close(fd)
        return total

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(read, range(threads)))
    return gbps(nbytes, time.perf_counter() - t0), nbytes


def summarize(rows: list[dict[str, Any]], raw: list[float], model: str = "") -> dict[str, Any]:
    """Medians and spreads per system and length; ours against the best configuration of each peer
    (HiCache, LMCache) and, where issue 36 set one for `model` and the length, the target
    (`spec.LONG_HISTORY_TARGETS`: `target_<length>`, and whether ours met it against every peer)."""
    figures: dict[str, Any] = {}
    cases = sorted({(r["length"], r.get("new_tokens", QUESTION)) for r in rows})
    for length, n in cases:
        k = key(length, n)
        case = [r for r in rows if r["length"] == length and r.get("new_tokens", QUESTION) == n]
        best: dict[str, tuple[float, str]] = {}  # peer -> its lowest resume and that configuration
        for name in dict.fromkeys(r["system"] for r in case):
            mine = [r for r in case if r["system"] == name]
            for field in ("resume_ms", "resident_ms"):
                values = [r[field] for r in mine]
                figures[f"{name}_{field}_{k}"] = statistics.median(values)
                figures[f"{name}_{field}_spread_{k}"] = [min(values), max(values)]
            figures[f"{name}_cached_{k}"] = min(r["cached"] for r in mine)
            resume = figures[f"{name}_resume_ms_{k}"]
            for peer, members in FAMILIES.items():
                if name in members and (peer not in best or resume < best[peer][0]):
                    best[peer] = (resume, name)
        for system in OURS:
            ours = [r for r in case if r["system"] == system]
            if not ours:
                continue
            figures |= _ours(ours, k, raw, system)
            for peer, (resume, name) in best.items():
                figures[f"best_{peer}_{k}"] = name
                figures[f"{system}_vs_best_{peer}_{k}"] = figures[f"{system}_resume_ms_{k}"] / resume
            target = LONG_HISTORY_TARGETS.get((model, length))
            if system == "ours" and n == QUESTION and target is not None and best:
                figures[f"target_{k}"] = str(target)
                figures[f"target_met_{k}"] = all(
                    target.met(figures[f"ours_vs_best_{peer}_{k}"]) for peer in best
                )
    if raw:
        figures["raw_read_gbps"] = statistics.median(raw)
        figures["raw_read_gbps_spread"] = [min(raw), max(raw)]
    return figures


def _ours(rows: list[dict[str, Any]], k: str, raw: list[float], name: str = "ours") -> dict[str, Any]:
    """Ours' phases (medians, ms), restore overhead (resume - resident), the share of the restore's
    read time hidden behind the prefill, resume over resident, and the issue-25 bound:
    overhead <= 1.25 x restored bytes / raw read GB/s + unpack time."""
    out: dict[str, Any] = {}
    for p in PHASES:
        out[f"{name}_{_short(p)}_ms_{k}"] = statistics.median(r.get(p, 0.0) for r in rows) * 1e3
    overheads = [r["resume_ms"] - r["resident_ms"] for r in rows]
    out[f"{name}_overhead_ms_{k}"] = overhead = statistics.median(overheads)
    read_ms = out[f"{name}_read_ms_{k}"]
    out[f"{name}_hidden_share_{k}"] = min(1.0, max(0.0, 1 - overhead / read_ms)) if read_ms > 0 else None
    resident = statistics.median(r["resident_ms"] for r in rows)
    out[f"{name}_vs_resident_{k}"] = (
        statistics.median(r["resume_ms"] for r in rows) / resident if resident else None
    )
    restored = statistics.median(r["restored_bytes"] for r in rows)
    out[f"{name}_restored_mb_{k}"] = restored / 2**20
    if raw:
        raw_ms = restored / (statistics.median(raw) * 1e9) * 1e3
        bound = 1.25 * raw_ms + out[f"{name}_unpack_ms_{k}"]
        out[f"{name}_overhead_bound_ms_{k}"] = bound
        out[f"{name}_overhead_within_bound_{k}"] = overhead <= bound
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="kvheavy", help="kvheavy, small, smollm2 or a model dir (default %(default)s)"
    )
    p.add_argument("--lengths", default="8192,16384", help="history lengths, tokens (default %(default)s)")
    p.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated (default %(default)s: the peers' strongest configurations) of {', '.join(SYSTEMS)}; "
        "hicache, lmcache = all configurations of that peer, all = every system",
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="each system once per round, order reversed every other round"
    )
    p.add_argument("--repeats", type=int, default=2, help="evict + resume cycles per server and length")
    p.add_argument(
        "--new-tokens",
        default=str(QUESTION),
        help="new tokens of the resumed turn, a comma list (issue 37: 0,256,1024,4096; default %(default)s)",
    )
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument(
        "--host-budget-mb",
        type=int,
        default=None,
        help="our staging, what the *-budget HiCache host pools add to the device pool, LMCache's L1 "
        "(default: 1.5 x the longest history)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dir", type=Path, default=Path("out/bench-long"), help="work dir on the disk to measure")
    args = p.parse_args(argv)  # fmt: skip
    try:
        lengths = sorted(int(x) for x in args.lengths.split(","))
        new_tokens = tuple(sorted({int(x) for x in args.new_tokens.split(",")}))
        names = _systems(args.systems, args.device)
        if min(lengths) < 256 or args.rounds < 1 or args.repeats < 1:
            raise ValueError("lengths must be >= 256, rounds and repeats >= 1")
        if min(new_tokens) < 0:
            raise ValueError("new tokens must be >= 0")
    except ValueError as e:
        print(f"long_history: {e}", file=sys.stderr)
        return 2
    try:
        workdir, model, shape, systems = prepare(args.dir, "long-", args.model, names, max(lengths),
                                                 args.page_size, args.device, args.host_budget_mb,
                                                 max(new_tokens))  # fmt: skip
    except SpecError as e:
        print(f"long_history: {e}", file=sys.stderr)
        return 2
    pool, host_mb = shape.pool_tokens, shape.host_budget_mb
    rows: list[dict[str, Any]] = []
    raw: list[float] = []
    for round_ in range(args.rounds):
        for system in systems if round_ % 2 == 0 else systems[::-1]:
            rows += run_server(system, shape, model, lengths, args.repeats, round_, workdir, new_tokens)
            save_rows(workdir, rows)  # a run stopped midway keeps the servers finished before
            if system.name in OURS and system.tier_dir is not None:
                speed, nbytes = raw_read_gbps(system.tier_dir, TierConfig().io_threads)
                raw.append(speed)
                log(
                    f"r{round_} raw parallel read of ours' tier: {speed:.2f} GB/s over {nbytes / 2**20:.0f} MiB"
                )
            if system.tier_dir is not None:  # a 16K history's tier is GiBs: never left to fill the disk
                shutil.rmtree(system.tier_dir, ignore_errors=True)
    figures = {"model": args.model, "device": args.device, "pool_tokens": pool, "host_budget_mb": host_mb,
               "page_size": args.page_size, "rounds": args.rounds, "repeats": args.repeats,
               "new_tokens": list(new_tokens),
               "rows": str(workdir / "rows.json"), **summarize(rows, raw, args.model)}  # fmt: skip
    emit(figures)
    return 0


def prepare(out_dir: Path, prefix: str, model_name: str, names: list[str], longest: int, page_size: int,
            device: str, host_budget_mb: int | None = None,
            new_tokens: int = QUESTION) -> tuple[Path, Path, Shape, list[System]]:  # fmt: skip
    """A run's new work dir under `out_dir`, its model, its shape (a device pool of the longest
    history + 4,096 tokens, or more where the longest turn needs it: `pool_tokens`; host budget
    default 1.5 x the longest history's KV) and its systems, on CPU each with the CPU profile's
    extend attention over new rows only. Raises SpecError."""
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir)).resolve()
    model = resolve_model(model_name, out_dir.resolve())
    host_mb = host_budget_mb or int(1.5 * longest * kv_bytes_per_token(model) / 2**20) + 1
    shape = Shape(model=str(model), pool_tokens=pool_tokens(longest, new_tokens, page_size), host_budget_mb=host_mb,
                  page_size=page_size, chunked_prefill=4096, device=device)  # fmt: skip
    env: tuple[tuple[str, str], ...] = ()
    if device == "cpu":
        from sgl_hicache_cpu.cpu_prefix_attention import ENV_VAR as PREFIX_ATTENTION_ENV

        env = ((PREFIX_ATTENTION_ENV, "1"),)
    check_hicache_holds(names, shape, model, longest)
    shape = measured_shape(shape, names, workdir)
    systems = [replace(s, env=(*s.env, *env)) for s in (build(n, shape, model, workdir) for n in names)]
    return workdir, model, shape, systems


def pool_tokens(longest: int, new_tokens: int, page_size: int) -> int:
    """The device pool: the longest history + 4,096 tokens, or, where that is short, whole pages that
    let sglang admit the longest turn (history + `new_tokens`, one token generated): its admission
    needs prompt + new + page_size < pool (`sgl_hicache.server.prompt_fit`), and a pool of exactly
    history + new + page_size never admitted the turn (plain sglang queued it forever)."""
    need = longest + new_tokens + 1 + page_size + 1
    return max(longest + 4096, -(-need // page_size) * page_size)


def save_rows(workdir: Path, rows: list[dict[str, Any]]) -> None:
    """`rows.json`, replaced whole (a kill mid-write leaves the previous one); a failed write is
    said on stderr and does not stop the run."""
    try:
        with replaced_whole(workdir / "rows.json") as tmp:
            tmp.write_text(json.dumps(rows, indent=1))
    except OSError as e:
        print(f"long_history: could not save rows so far: {e}", file=sys.stderr)


def _systems(names: str, device: str = "cpu") -> list[str]:
    """`--systems` as `spec.expand_systems` reads it, over this benchmark's systems (ValueError)."""
    try:
        return list(expand_systems(names, device, SYSTEMS))
    except SpecError as e:
        raise ValueError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
