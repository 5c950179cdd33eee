"""`python -m sgl_hicache.cli ...`, the same as the `sgl-hicache` console script."""

import sys

from sgl_hicache.cli import main

if __name__ == "__main__":
    sys.exit(main())
