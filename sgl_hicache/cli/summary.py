"""`sgl-hicache inspect`: per-namespace totals from the extents' fixed headers (no payload reads).

Header MACs are checked when the directory's secret can be read; if not, a warning goes to stderr
and the JSON says `"macs_verified": false`."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sgl_hicache.cli.tier_files import NsFiles, classify, directory_seal, key_of, namespace_dirs
from sgl_hicache.tier.format import ALIGN, DirectoryMac, FormatError, Header, decode_fixed
from sgl_hicache.tier.keys import NamespaceId, chain_key_from_digest


@dataclass(frozen=True)
class NsSummary:
    """One namespace. Counts, bytes and ages cover extents with a valid header (`bad_headers`
    counts the others); ages are from the header's publish time."""

    namespace: str
    layout: str
    extents: int
    file_bytes: int
    payload_bytes: int
    tokens: int
    oldest_age_s: float | None
    newest_age_s: float | None
    bad_headers: int
    stale_temp_files: int
    live_temp_files: int


def summarize(files: NsFiles, now_ns: int, seal: DirectoryMac | None) -> NsSummary:
    headers: list[tuple[Header, int]] = []
    bad = 0
    for de in files.extents:
        try:
            headers.append(_valid_header(de, files.ns, seal))
        except FileNotFoundError:
            continue  # evicted meanwhile
        except (FormatError, OSError):
            bad += 1
    ages = [(now_ns - h.created_ns) / 1e9 for h, _ in headers]
    return NsSummary(
        files.ns.hex(), _layout(headers[0][0]) if headers else "-", len(headers),
        sum(size for _, size in headers), sum(h.payload_len for h, _ in headers),
        sum(h.token_count for h, _ in headers), max(ages, default=None), min(ages, default=None),
        bad, len(files.stale_temps), len(files.live_temps),
    )  # fmt: skip


def _valid_header(de: os.DirEntry[str], ns: NamespaceId, seal: DirectoryMac | None) -> tuple[Header, int]:
    """Header and file size of an extent the tier's startup scan would index (its MAC checked only
    with a `seal`); raises FormatError."""
    with open(de.path, "rb", buffering=0) as f:
        header, size = decode_fixed(f.read(ALIGN), seal), os.fstat(f.fileno()).st_size
    if header.namespace != ns or header.key != key_of(de) or size < header.file_size:
        raise FormatError("foreign, misplaced or truncated extent")
    if chain_key_from_digest(ns, header.parent, header.token_count, header.token_digest) != header.key:
        raise FormatError("key does not match the header's parent, token count and digest")
    return header, size


def _layout(h: Header) -> str:
    lay = h.layout
    return f"L{lay.num_layers} H{lay.num_heads} D{lay.head_dim} {lay.dtype.name.lower()} p{lay.page_size}"


def human_bytes(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(int(seconds), 0)
    if s >= 86400:
        return f"{s // 86400}d{s // 3600 % 24:02d}h"
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s"


COLUMNS = ["NAMESPACE", "LAYOUT", "EXTENTS", "FILE", "PAYLOAD", "TOKENS", "OLDEST", "NEWEST", "BAD", "TMP"]


def format_table(rows: list[NsSummary]) -> str:
    """One line per namespace; TMP is `stale/live` temp files."""
    cells = [COLUMNS] + [
        [r.namespace, r.layout, str(r.extents), human_bytes(r.file_bytes), human_bytes(r.payload_bytes),
         str(r.tokens), human_age(r.oldest_age_s), human_age(r.newest_age_s), str(r.bad_headers),
         f"{r.stale_temp_files}/{r.live_temp_files}"]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells)
    return "\n".join(line.rstrip() for line in lines)


def cmd_inspect(root: Path, as_json: bool) -> int:
    now = time.time_ns()
    dirs = namespace_dirs(root)
    seal, macs = directory_seal(root)
    if seal is None:
        print(f"sgl-hicache inspect: {macs}", file=sys.stderr)
    rows = [summarize(classify(d, now / 1e9), now, seal) for d in dirs]
    if as_json:
        report = {
            "directory": str(root),
            "macs_verified": seal is not None,
            "namespaces": [asdict(r) for r in rows],
        }
        print(json.dumps(report))
    else:
        print(format_table(rows))
    return 0
