"""A restore's loads on the file tier and on a Mooncake Store, side by side (issue 40).

    python -m benchmarks.tier_loads [--quick] [--group-order] [--dir DIR] [--tokens 256] [--repeats R]

A restore reads its extents as one batch: the first load's ticket is every later load's `batch`
(`Tier.submit_load`, `cache/reads.py`). A layer-wise restore's loads ask for group order
(`--group-order`: the tier reads them layer group by layer group); a whole restore's do not (the
default here, as the default server: Mooncake then reads every group of the batch in one call,
`load_calls` merged). Here N extents of SmolLM2-135M's KV (30 layers, 3 KV heads of 64
dims, bf16, pages of 16 tokens; `--tokens` tokens each, in the cache's layer groups) are stored
once by a writer tier; a reader tier of 1 or 4 I/O threads (another server, its destinations in
memory registered with it) then submits all N loads at once as one batch and is timed until every
one completed, for N in 1, 8 and 40. On the file tier (a directory under `--dir`, O_DIRECT reads
where the volume allows) and on a Mooncake Store (a master on loopback started here, stopped by
its process group; the extents in the writer's segment, read over TCP), taking turns within each
repetition. Every loaded byte is checked once per configuration; each figure is the median of the
repeats (min-max logged and in `<figure>_range`). Mooncake is skipped, with the reason, where its
client cannot be imported.

A third reader, `mooncake-own`, stores the extents itself before it reads them (under a salt of its
own, so it writes its own objects, with `placement` local: into its own segment), as a server
restores what it spilled; the `mooncake` reader reads the writer's, as a server restores what
another spilled. A fourth, `mooncake-standalone`, joins a store of its own (a second master)
through a real client (`mooncake_client`, Mooncake's standalone mode, `MooncakeConfig.real_client`)
and reads what another tier stored through it: the real client holds every object and copies it
into the reader's destinations, shared memory it maps (`Tier.host_memory`, as the server's staging).

Figures: `<reader>_ms_n<N>_t<T>` for file, mooncake, mooncake_own, mooncake_standalone; for each
Mooncake reader `<reader>_vs_file_n<N>_t<T>` (its ratio to files) and `<reader>_vs_file_n<N>`
(the larger ratio of the two thread counts).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sgl_hicache_kernels.layout import default_group_layers

from benchmarks.bench.mooncake_process import MooncakeMaster, MooncakeRealClient
from benchmarks.bench.server_process import install_reaper
from benchmarks.harness import emit, log
from sgl_hicache.config import MiB, MooncakeConfig, SpillBackend, TierConfig
from sgl_hicache.tier import (
    ROOT_KEY,
    ExtentKey,
    KVDtype,
    KVLayout,
    Namespace,
    Tier,
    chain_key,
    open_tier,
)

NS = Namespace("bench-tier-loads", KVLayout(30, 3, 64, KVDtype.BF16, 16))
GROUP_LAYERS = default_group_layers(NS.layout.num_layers)  # as the cache writes them: 4 groups
COUNTS = (1, 8, 40)
THREADS = (1, 4)
WAIT_S = 120.0


@dataclass(frozen=True)
class Extents:
    keys: list[ExtentKey]
    tokens: list[list[int]]
    payloads: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(self.payloads[0].nbytes)


def make_extents(n: int, tokens: int) -> Extents:
    """`n` extents of `tokens` tokens each (whole pages), random bytes of the namespace's KV size."""
    lay = NS.layout
    per_token = 2 * lay.num_layers * lay.num_heads * lay.head_dim * lay.dtype.itemsize
    toks = [list(range(i * 1_000_000, i * 1_000_000 + tokens)) for i in range(n)]
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, tokens * per_token, dtype=np.uint8) for _ in range(n)]
    return Extents([chain_key(NS.id, ROOT_KEY, t) for t in toks], toks, payloads)


def store_all(tier: Tier, ext: Extents, cache_salt: str | None = None) -> None:
    tickets = [
        tier.submit_store(k, p, t, ROOT_KEY, group_layers=GROUP_LAYERS, cache_salt=cache_salt)
        for k, t, p in zip(ext.keys, ext.tokens, ext.payloads, strict=True)
    ]
    bad = [c for c in (tier.wait(t, WAIT_S) for t in tickets) if not c.ok]
    assert not bad, f"stores failed: {bad[:3]}"


def load_batch(tier: Tier, keys: list[ExtentKey], dests: list[memoryview], group_order: bool) -> float:
    """Seconds from submitting the loads of `keys` as one batch (the first load's ticket, as a
    restore's; in layer-group order if `group_order`) until every one completed; each must be OK
    and whole."""
    t0 = time.perf_counter()
    first = tier.submit_load(keys[0], dests[0], group_layers=GROUP_LAYERS, group_order=group_order)
    tickets = [first] + [
        tier.submit_load(k, d, group_layers=GROUP_LAYERS, batch=first, group_order=group_order)
        for k, d in zip(keys[1:], dests[1:], strict=True)
    ]
    done = [tier.wait(t, WAIT_S) for t in tickets]
    elapsed = time.perf_counter() - t0
    bad = [c for c, d in zip(done, dests, strict=True) if not c.ok or c.nbytes != d.nbytes]
    assert not bad, f"loads failed: {bad[:3]}"
    return elapsed


class Reader:
    """One backend's reader tier of `threads` I/O threads, with destinations for every extent in
    one arena registered with it (as the cache registers its staging)."""

    def __init__(self, name: str, tier: Tier, ext: Extents, group_order: bool) -> None:
        self.name, self.tier, self.ext, self.group_order = name, tier, ext, group_order
        self._arena = tier.host_memory(len(ext.keys) * ext.nbytes)  # as the server makes its staging
        tier.register_host_memory(self._arena)
        self.dests = [self._arena[i * ext.nbytes : (i + 1) * ext.nbytes] for i in range(len(ext.keys))]
        load_batch(tier, ext.keys[:1], self.dests[:1], group_order)  # warm-up: first-use buffers, connections

    def run(self, n: int, check: bool) -> float:
        """One batch of the first `n` extents into zeroed destinations; every byte checked if `check`."""
        np.frombuffer(self._arena, np.uint8)[: n * self.ext.nbytes] = 0
        seconds = load_batch(self.tier, self.ext.keys[:n], self.dests[:n], self.group_order)
        if check:
            for i in range(n):
                assert np.array_equal(np.frombuffer(self.dests[i], np.uint8), self.ext.payloads[i]), (
                    f"{self.name}: extent {i} loaded other bytes than were stored"
                )
        return seconds


def file_config(root: Path, threads: int) -> TierConfig:
    return TierConfig(directory=root / "files", capacity_bytes=1 << 42, min_free_bytes=0, io_threads=threads)


def mooncake_config(root: Path, master: MooncakeMaster, threads: int, segment: int,
                    placement: str = "any") -> TierConfig:  # fmt: skip
    mooncake = dataclasses.replace(master.config(segment_bytes=segment), placement=placement)
    return TierConfig(backend=SpillBackend.MOONCAKE, mooncake=mooncake,
                      directory=root / "mooncake", io_threads=threads)  # fmt: skip


def standalone_config(root: Path, client: MooncakeRealClient, threads: int) -> TierConfig:
    mooncake = MooncakeConfig(real_client=client.address, local_buffer_size=16 * MiB)
    return TierConfig(backend=SpillBackend.MOONCAKE, mooncake=mooncake,
                      directory=root / "mooncake", io_threads=threads)  # fmt: skip


def mooncake_missing() -> str | None:
    """Why the Mooncake client cannot be used here, or None."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"mooncake.store cannot be imported ({e}); run scripts/setup_venv.sh"
    return None


Times = dict[tuple[str, int, int], list[float]]


def measure(
    openers: dict[str, Callable[[int], Tier]], ext: Extents, repeats: int, group_order: bool
) -> Times:
    """Per (backend, N, threads): the seconds of each repetition; the backends take turns."""
    times: Times = {}
    for threads in THREADS:
        with contextlib.ExitStack() as stack:
            readers = [
                Reader(name, stack.enter_context(opener(threads)), ext, group_order)
                for name, opener in openers.items()
            ]
            for n in COUNTS:
                for r in range(repeats):
                    for reader in readers:
                        times.setdefault((reader.name, n, threads), []).append(reader.run(n, check=r == 0))
    return times


@contextlib.contextmanager
def backends(
    root: Path, ext: Extents, skip_mooncake: str | None
) -> Iterator[dict[str, Callable[[int], Tier]]]:
    """Each backend's reader opener, its extents stored by a writer tier first (the Mooncake
    writer stays open: its segment holds them)."""
    with open_tier(file_config(root, 4), NS) as writer:
        store_all(writer, ext)
    openers: dict[str, Callable[[int], Tier]] = {"file": lambda t: open_tier(file_config(root, t), NS)}
    if skip_mooncake is not None:
        yield openers
        return
    segment = max(256 * MiB, 2 * len(ext.keys) * ext.nbytes)
    (root / "mooncake-logs").mkdir()
    (root / "standalone-logs").mkdir()
    with (
        MooncakeMaster(root / "mooncake-logs") as master,
        MooncakeMaster(root / "standalone-logs") as own_master,  # a store of its own: no shared names
        MooncakeRealClient(own_master, root / "standalone-logs", 2 * segment) as real_client,
    ):
        with open_tier(standalone_config(root, real_client, 4), NS) as through:  # the objects outlive it
            store_all(through, ext)
        writer = open_tier(mooncake_config(root, master, 4, segment), NS)
        try:
            store_all(writer, ext)
            openers["mooncake"] = lambda t: open_tier(mooncake_config(root, master, t, 32 * MiB), NS)
            openers["mooncake-own"] = lambda t: own_reader(
                mooncake_config(root, master, t, segment, "local"), ext
            )
            openers["mooncake-standalone"] = lambda t: open_tier(standalone_config(root, real_client, t), NS)
            yield openers
        finally:
            writer.close(30)  # before its master goes


def own_reader(cfg: TierConfig, ext: Extents) -> Tier:
    """A reader that stored the extents itself first (a server restoring what it spilled): under a
    salt of its own, so that it writes its own objects (placement local: into its own segment)
    rather than finding the writer's."""
    tier = open_tier(cfg, NS)
    try:
        store_all(tier, ext, cache_salt="own")
    except BaseException:
        tier.close(30)
        raise
    return tier


def figures_of(times: Times) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for (name, n, threads), secs in sorted(times.items()):
        ms = [s * 1000 for s in secs]
        fig = f"{name.replace('-', '_')}_ms_n{n}_t{threads}"
        out[fig], out[f"{fig}_range"] = statistics.median(ms), [round(min(ms), 2), round(max(ms), 2)]
        log(f"{name:8} N={n:2} threads={threads}: median {out[fig]:7.2f} ms ({min(ms):.2f}-{max(ms):.2f})")
    for name in ("mooncake", "mooncake-own", "mooncake-standalone"):
        fig = name.replace("-", "_")
        for n in COUNTS:
            ratios = {t: out[f"{fig}_ms_n{n}_t{t}"] / out[f"file_ms_n{n}_t{t}"] for t in THREADS
                      if f"{fig}_ms_n{n}_t{t}" in out}  # fmt: skip
            for t, ratio in ratios.items():
                out[f"{fig}_vs_file_n{n}_t{t}"] = ratio
            if ratios:
                out[f"{fig}_vs_file_n{n}"] = max(ratios.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dir", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "bench_tier_loads"
    )
    ap.add_argument("--quick", action="store_true", help="three repetitions (< 60 s)")
    ap.add_argument(
        "--group-order", action="store_true", help="a layer-wise restore's loads (read group by group)"
    )
    ap.add_argument("--tokens", type=int, default=256, help="tokens per extent (a multiple of 16)")
    ap.add_argument("--repeats", type=int, default=0, help="repetitions (default: 3 quick, 9 otherwise)")
    args = ap.parse_args()
    if args.tokens <= 0 or args.tokens % NS.layout.page_size:
        ap.error(f"--tokens must be a positive multiple of {NS.layout.page_size}")
    repeats = args.repeats or (3 if args.quick else 9)
    install_reaper()  # the master is stopped on SIGINT/SIGTERM too
    skip_mooncake = mooncake_missing()
    if skip_mooncake:
        log(f"Mooncake skipped: {skip_mooncake}")
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ext = make_extents(max(COUNTS), args.tokens)
    log(f"{len(ext.keys)} extents of {args.tokens} tokens ({ext.nbytes / MiB:.2f} MiB, {GROUP_LAYERS} layers "
        f"a group) on {root}; {repeats} repetitions, median (min-max)")  # fmt: skip
    try:
        with backends(root, ext, skip_mooncake) as openers:
            times = measure(openers, ext, repeats, args.group_order)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures = figures_of(times)
    figures.update(group_order=args.group_order, tokens=args.tokens, extent_bytes=ext.nbytes, group_layers=GROUP_LAYERS, repeats=repeats,
                   counts=list(COUNTS), threads=list(THREADS), mooncake=skip_mooncake or "measured")  # fmt: skip
    emit(figures)


if __name__ == "__main__":
    main()
