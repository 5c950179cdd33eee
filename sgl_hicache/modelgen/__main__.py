"""`python -m sgl_hicache.modelgen --size tiny --out DIR [--seed 0]`"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sgl_hicache.modelgen.generate import SIZES, generate_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_hicache.modelgen", description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(generate_model(args.out, args.size, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
