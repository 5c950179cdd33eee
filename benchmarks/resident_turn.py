"""A turn over a long *resident* history, right after it was cached and after the server idled.

    python -m benchmarks.resident_turn [--model kvheavy] [--length 16384] [--systems recompute,hicache-wait-r2,ours]
                                       [--idle-s 30] [--dir out/bench-long]

`long_history` measures each system's resident turn (the floor its resumed turn is compared with)
on its own server. At 16K on `kvheavy` that floor came out 2.0-2.5 s on sglang's default cache but
4.4-7.9 s on HiCache's and ours' servers, one round each (docs/RESULTS.md). This probe looks at
that floor alone, in the same conditions for every system (same shape, CPU prefix attention, one
server at a time): a history of `--length` tokens is served, then a 96-token question on it at
once (`resident_now_ms`: beside whatever the server does in the background after an insert, e.g.
our clean-ahead writes or HiCache's write-through) and again after `--idle-s` of idling
(`resident_settled_ms`, twice). For ours the history is then pushed out by other work, resumed
from the tier, and asked again at once and after idling (`resident_after_resume_*`). Also reported:
each server's CPU seconds over the idle period (sglang's scheduler polls, so an idle server is
not free on a small machine). Ends with one JSON line of named figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench.spec import Shape, SpecError
from benchmarks.bench.systems import System
from benchmarks.harness import emit, log
from benchmarks.long_history import QUESTION, SYSTEMS, filler_tokens, other_work, prepare, settle
from benchmarks.resume import naming_log, seq, ttft

DEFAULT_SYSTEMS = ("recompute", "hicache-wait-r2", "ours")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group `pgid`."""
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def probe(
    system: System, shape: Shape, model: Path, length: int, idle_s: float, workdir: Path
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    log_path = workdir / f"{system.name}.log"
    with system.server(model, log_path).start(timeout_s=600) as server, naming_log(log_path):
        assert server.proc is not None
        base, pgid = server.base_url, server.proc.pid
        history = seq(77, length)
        t0 = time.perf_counter()
        ttft(base, history)
        out["history_s"] = time.perf_counter() - t0

        def resident(phase: str, seed: int) -> None:
            out[f"{phase}now_ms"], _ = ttft(base, history + seq(seed, QUESTION))
            cpu = group_cpu_s(pgid)
            time.sleep(idle_s)
            out[f"{phase}idle_cpu_s"] = group_cpu_s(pgid) - cpu
            out[f"{phase}settled_ms"] = [ttft(base, history + seq(seed + k, QUESTION))[0] for k in (1, 2)]

        resident("resident_", 7)
        if system.name == "ours":
            other_work(base, filler_tokens(system, shape, model), seed=5)
            settle(system, base)
            out["resume_ms"], out["resume_cached"] = ttft(base, history + seq(10, QUESTION))
            resident("resident_after_resume_", 20)
    log(f"{system.name}: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="kvheavy", help="kvheavy, small, smollm2 or a model dir (default %(default)s)"
    )
    p.add_argument("--length", type=int, default=16384, help="history tokens (default %(default)s)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"some of {', '.join(SYSTEMS)} (default %(default)s)")  # fmt: skip
    p.add_argument("--idle-s", type=float, default=30.0, help="seconds idled before the settled turns")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--dir", type=Path, default=Path("out/bench-long"), help="work dir (default %(default)s)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    if not names or set(names) - set(SYSTEMS) or args.length < 256 or args.idle_s < 0:
        print(f"resident_turn: --systems must name some of {', '.join(SYSTEMS)}; --length >= 256, --idle-s >= 0",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        workdir, model, shape, systems = prepare(args.dir, "resident-", args.model, names, args.length,
                                                 args.page_size, "cpu")  # fmt: skip
    except SpecError as e:
        print(f"resident_turn: {e}", file=sys.stderr)
        return 2
    figures: dict[str, Any] = {"model": args.model, "length": args.length, "idle_s": args.idle_s}
    for system in systems:
        for key, value in probe(system, shape, model, args.length, args.idle_s, workdir).items():
            figures[f"{system.name}_{key}"] = value
        if system.tier_dir is not None:  # GiBs at 16K: never left to fill the disk
            shutil.rmtree(system.tier_dir, ignore_errors=True)
    emit(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
