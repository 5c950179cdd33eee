import sys

from benchmarks.bench.cli import main

sys.exit(main())
