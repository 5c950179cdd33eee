"""`python -m sgl_hicache.bench`: the serving benchmark, run from a source checkout.

The benchmark lives in the repository's `benchmarks/bench/` (with the model generator and the other
benchmarks), not in the runtime wheel; this module only forwards to it. Run it from the checkout's
root after `make setup` (or, on a GPU box, after installing this package and `pip install -e ./cpu`
is not needed: see docs/DEVELOPMENT.md).
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from benchmarks.bench.cli import main as bench_main
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", "benchmarks.bench", "benchmarks.bench.cli"):
            raise
        print(
            "python -m sgl_hicache.bench: the benchmark runs from a source checkout of sgl-hicache "
            "(it is not in the installed package): run it from the checkout's root",
            file=sys.stderr,
        )
        return 2
    return bench_main()


if __name__ == "__main__":
    sys.exit(main())
