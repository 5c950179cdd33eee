"""The environment a `--device cpu --tp-size N` (N > 1) sglang server needs, as defaults.

- `SGLANG_PLATFORM=sgl_hicache_cpu` selects `sgl_hicache_cpu.cpu_tp_platform`, without which
  start-up stops in PyNccl set-up (see that module).
- `SGLANG_CPU_OMP_THREADS_BIND`: sglang asserts, for N ranks, at least N NUMA nodes or this variable
  (`numa_utils.init_threads_binding`). The default splits the server's CPUs (those it is pinned to,
  else those this process may run on) into N contiguous groups (`cpu_shares`), e.g. `0|1` for 2 CPUs
  (`0-7|8-15` for 16); with fewer CPUs than ranks, ranks share them (`0|0` for one CPU).
  sglang binds OpenMP threads to it only where AMX or arm64 is present.

A variable already set is left as it is. `--config` files are not read: a TP width set only there gets
no defaults. Imports nothing heavy: `ServerProcess` calls it in the test driver.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

PLATFORM_ENV = "SGLANG_PLATFORM"
PLATFORM_NAME = "sgl_hicache_cpu"  # cpu_tp_platform.PLATFORM_NAME, the entry point's name
BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
TP_FLAGS = ("--tp-size", "--tensor-parallel-size")


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The value of the last `NAME VALUE` or `NAME=VALUE` in `argv` for any of `names` (argparse keeps
    the last)."""
    value = None
    for i, arg in enumerate(argv):
        name, eq, inline = arg.partition("=")
        if name in names:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


def tp_size(argv: Sequence[str]) -> int:
    """The TP width `argv` asks for (1 when absent or not a number; sglang reports bad values)."""
    value = flag_value(argv, *TP_FLAGS)
    return int(value) if value is not None and value.isdigit() else 1


def cpu_shares(cpus: Iterable[int], n: int) -> tuple[tuple[int, ...], ...]:
    """`n` shares of `cpus` (sorted): disjoint, contiguous, sizes differing by at most one (the larger
    first), e.g. `((0,), (1,))` for 2 CPUs, `((0, 1), (2,))` for 3. With fewer CPUs than `n`, share i
    is the one CPU i mod len: shares then overlap. Raises ValueError for no CPUs or `n` < 1."""
    ordered = sorted(cpus)
    if not ordered or n < 1:
        raise ValueError(f"cannot split {len(ordered)} CPUs into {n} shares")
    if len(ordered) < n:
        return tuple((ordered[i % len(ordered)],) for i in range(n))
    size, extra = divmod(len(ordered), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return tuple(tuple(ordered[bounds[i] : bounds[i + 1]]) for i in range(n))


def split_cpus(cpus: Iterable[int], ranks: int) -> str:
    """`cpu_shares(cpus, ranks)` in sglang's `SGLANG_CPU_OMP_THREADS_BIND` syntax, e.g. `0-7|8-15`."""
    return "|".join(_cpu_list(share) for share in cpu_shares(cpus, ranks))


def _cpu_list(cpus: Sequence[int]) -> str:
    if len(cpus) == 1:
        return str(cpus[0])
    if cpus[-1] - cpus[0] == len(cpus) - 1:
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def cpu_tp_env(
    argv: Sequence[str], environ: Mapping[str, str] | None = None, cpus: Iterable[int] | None = None
) -> dict[str, str]:
    """The variables to add to `environ` for sglang arguments `argv`, run on `cpus` (default: the CPUs
    this process may run on): none unless `--device cpu` and a TP width above 1; never one `environ`
    already has."""
    environ = os.environ if environ is None else environ
    ranks = tp_size(argv)
    if flag_value(argv, "--device") != "cpu" or ranks < 2:
        return {}
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    defaults = {PLATFORM_ENV: PLATFORM_NAME, BIND_ENV: split_cpus(cpus, ranks)}
    return {k: v for k, v in defaults.items() if k not in environ}
