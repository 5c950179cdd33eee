"""`python -m sgl_hicache.bench`: the serving benchmark, run from the root of a source checkout.

The benchmark lives in the repository's `benchmarks/bench/` (with the model generator and the other
benchmarks), not in the runtime wheel; this module only forwards to it. Run it from the checkout's
root (`python -m` puts the working directory on the import path, so `benchmarks` is found there)
after `make setup` (on a GPU box, after installing the kernels and this package: the CPU profile is
not needed; see docs/DEVELOPMENT.md). Elsewhere it says where to run it and exits 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]  # the checkout's root, where this is an editable install


def where_to_run() -> str:
    """The checkout this module is in (an editable install, or run from it), else in words."""
    return str(CHECKOUT) if (CHECKOUT / "benchmarks" / "bench" / "cli.py").is_file() else "a checkout's root"


def main() -> int:
    try:
        from benchmarks.bench.cli import main as bench_main
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", "benchmarks.bench", "benchmarks.bench.cli"):
            raise
        print(
            "python -m sgl_hicache.bench: the benchmark runs from a source checkout of sgl-hicache "
            f"(it is not in the installed package): run it from {where_to_run()}",
            file=sys.stderr,
        )
        return 2
    return bench_main()


if __name__ == "__main__":
    sys.exit(main())
