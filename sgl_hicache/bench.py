"""`python -m sgl_hicache.bench`: the serving benchmark, run from a source checkout.

The benchmark lives in the repository's `benchmarks/bench/` (with the model generator and the other
benchmarks), not in the runtime wheel; this module only forwards to it. Run it from the checkout's
root after `make setup` (or, on a GPU box, after installing this package and `pip install -e ./cpu`
is not needed: see docs/DEVELOPMENT.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]  # the checkout's root, where this is an editable install


def main() -> int:
    if (CHECKOUT / "benchmarks" / "bench" / "cli.py").is_file() and str(CHECKOUT) not in sys.path:
        sys.path.append(str(CHECKOUT))
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
