"""`python -m sgl_hicache_cpu.install_cpu_shim [--remove]`: write (or remove) the `.pth` line
that installs the `sgl_kernel` CPU shim finder at interpreter start in this environment.

Only the CPU profile's setup runs this; see `sgl_hicache_cpu.cpu_shim_hook` for why a `.pth`.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "sgl_hicache_cpu_shim.pth"
PTH_LINE = "import sgl_hicache_cpu.cpu_shim_hook as _h; _h.install()\n"


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_hicache_cpu.install_cpu_shim")
    parser.add_argument("--remove", action="store_true", help="remove the .pth instead of writing it")
    args = parser.parse_args(argv)
    path = pth_path()
    if args.remove:
        path.unlink(missing_ok=True)
        print(f"removed {path}")
    else:
        path.write_text(PTH_LINE)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
