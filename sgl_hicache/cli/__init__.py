"""`sgl-hicache`: the operator's view of a tier directory (docs/FORMAT.md), from the files alone.

    sgl-hicache inspect DIR [--json]   per namespace: extents, bytes, tokens, ages, temp files
    sgl-hicache fsck DIR [--repair] [--cache-salt SALT]
                                       verify every byte of every extent; remove what is broken;
                                       list (remove) every extent of a tenant salt

No model, namespace or server is needed: every 32-hex subdirectory of DIR is a namespace, and each
extent is read with the tier's own code (`format.decode_fixed`, `load.open_extent`/`read_chunk`),
so fsck accepts exactly what a load accepts (header and meta MACs included, when it can read the
directory's `.secret`: run it as the server's user). Imports neither torch nor sglang.

tier_files.py  a tier's namespace dirs, their files sorted by role (extents, stale / live temp files)
summary.py     inspect: header-only totals, table or JSON
fsck.py        fsck: full verification, --repair
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sgl_hicache.cli.fsck import cmd_fsck
from sgl_hicache.cli.summary import cmd_inspect
from sgl_hicache.cli.tier_files import UsageError

EXIT_USAGE = 2

_INSPECT = (
    "Per namespace: layout, extents, file and payload bytes, tokens, oldest/newest extent age (header "
    "publish time), extents with a bad header, stale/live temp files. Reads headers only. Hit counts are "
    "not shown: the tier does not record them (LRU order lives in each server process's memory)."
)
_FSCK = (
    "Read and verify every extent (header and meta MACs with the directory's secret, when readable; every "
    "chunk checksum); list broken extents and stale temp files. Exit 0: clean (or all repaired); 1: problems remain; 2: bad DIR. Run it on the host "
    "of the servers: temp files are judged by their writer's pid. Safe beside a running server (a "
    "removed extent is a clean miss for it; its byte accounting catches up at its next start)."
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sgl-hicache", description="Inspect and check a spill-tier directory.")
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser(
        "inspect", help="per-namespace counts, bytes, ages, temp files", description=_INSPECT
    )
    ins.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    fsck = sub.add_parser("fsck", help="verify every extent; --repair removes broken ones", description=_FSCK)
    fsck.add_argument("--repair", action="store_true", help="remove broken extents and stale temp files")
    fsck.add_argument("--cache-salt", metavar="SALT",
                      help="also list every extent of this cache_salt (none after a purge); --repair removes them")  # fmt: skip
    for sp in (ins, fsck):
        sp.add_argument("dir", type=Path, metavar="DIR", help="the tier directory (--hicache-spill-dir)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (2 with a one-line error for a bad DIR)."""
    args = parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return cmd_inspect(args.dir, args.json)
        return cmd_fsck(args.dir, args.repair, args.cache_salt)
    except UsageError as e:
        print(f"sgl-hicache {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
