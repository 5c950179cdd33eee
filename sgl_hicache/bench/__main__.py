import sys

from sgl_hicache.bench.cli import main

sys.exit(main())
