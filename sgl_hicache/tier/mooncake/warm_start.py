"""A Mooncake tier's warm start (`MooncakeTier` at open): the manifest's entries checked against the
store, sorted and counted, bad headers removed, the manifest compacted. Blocks, as a file scan.

Each entry (key, salt tag) the manifest names (manifest.py) is sorted by what the store holds,
three calls per `FIND_BATCH` entries (headers present, headers read, chunks present):

- found: its header verifies as a load's (MACs, namespace, key, salt) and every chunk it names is
  there: indexed (`scanned_extents`);
- newer: a header of a newer format version: kept for the newer server, not used (`newer_extents`);
- gone: its header, or a chunk, is not there (evicted, removed, purged): `warm_start_gone`;
- rejected: its header is there and does not verify (another deployment's secret, tampered,
  another key's header): never indexed; removed if it is still the bytes read (as a load drops
  it, and as the file scan removes a foreign or corrupt file), counted in `removed_bad_files`;
- unsure: the store did not answer for it (nothing is proven).

Records that did not verify are counted in `manifest_bad_records`. One log line gives the counts
(a warning where a header or a record was rejected: a trust event). Then the manifest is compacted
with the found, newer and unsure entries as its live ones (manifest.py's contract), unless the
store left an entry unsure: a store that cannot tell is no ground for dropping one. A failure of
the store is reported (and counted in `io_errors` where it stopped a compaction); it loses no entry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sgl_hicache.tier.faults import Counters, logger
from sgl_hicache.tier.format import DirectoryMac, FormatError, NewerFormat
from sgl_hicache.tier.keys import ExtentKey, NamespaceId
from sgl_hicache.tier.mooncake.client import Names, StoreClient
from sgl_hicache.tier.mooncake.manifest import Compaction, Entry, Manifest
from sgl_hicache.tier.mooncake.objects import Opened, verify_header
from sgl_hicache.tier.results import Op

FIND_BATCH = 256  # entries sorted per round of calls

Report = Callable[[Op, Exception], None]
"""How a failure of the store is reported (the tier's rate-limited `FaultLog`)."""


@dataclass
class Sorted:
    """The manifest's entries by what the store holds (the module doc)."""

    found: list[Opened] = field(default_factory=list)
    live: set[ExtentKey] = field(default_factory=set)  # found, newer, unsure: what a compaction keeps
    newer: int = 0
    gone: int = 0
    rejected: list[tuple[str, bytes]] = field(default_factory=list)  # header name, its bytes as read
    unsure: int = 0


def sort_entries(client: StoreClient, names: Names, ns: NamespaceId, seal: DirectoryMac,
                 entries: list[Entry]) -> Sorted:  # fmt: skip
    out = Sorted()
    for i in range(0, len(entries), FIND_BATCH):
        _sort_batch(client, names, ns, seal, entries[i : i + FIND_BATCH], out)
    return out


def _sort_batch(client: StoreClient, names: Names, ns: NamespaceId, seal: DirectoryMac, group: list[Entry],
                out: Sorted) -> None:  # fmt: skip
    there = []
    for (key, salt), x in zip(group, client.exist([names.header(k, s) for k, s in group]), strict=True):
        if x == 1:
            there.append((key, salt))
        elif x == 0:
            out.gone += 1
        else:
            out.unsure += 1
            out.live.add(key)
    opened: list[Opened] = []
    for (key, salt), raw in zip(there, client.get_many([names.header(k, s) for k, s in there]), strict=True):
        if raw is None:  # gone since the existence check, or the store did not answer
            out.unsure += 1
            out.live.add(key)
            continue
        try:
            opened.append(verify_header(raw, ns, key, salt, seal))
        except NewerFormat:  # a newer server's extent: kept, never used here
            out.newer += 1
            out.live.add(key)
        except FormatError:  # another deployment's, tampered, another key's: never indexed
            out.rejected.append((names.header(key, salt), raw))
    chunks = [ext.chunk_names(names) for ext in opened]
    flags = client.exist([name for c in chunks for name in c])
    at = 0
    for ext, c in zip(opened, chunks, strict=True):
        there_now, at = flags[at : at + len(c)], at + len(c)
        if 0 in there_now:  # a chunk went: the extent is gone
            out.gone += 1
            continue
        if all(x == 1 for x in there_now):
            out.found.append(ext)
        else:
            out.unsure += 1
        out.live.add(ext.header.key)


def drop_rejected(client: StoreClient, rejected: list[tuple[str, bytes]]) -> int:
    """Remove the rejected headers still holding the bytes read (one replaced by a good one before
    the re-read stays; the store has no compare-and-delete, so one replaced between the re-read and
    the removal goes: that extent's next load misses and it is stored again); how many went. Two
    calls."""
    if not rejected:
        return 0
    now = client.get_many([name for name, _ in rejected])
    still = [name for (name, raw), got in zip(rejected, now, strict=True) if got == raw]
    return sum(reply.ok for reply in client.remove_many(still))


def warm_start(client: StoreClient, names: Names, ns: NamespaceId, seal: DirectoryMac, manifest: Manifest,
               counters: Counters, report: Report) -> list[Opened]:  # fmt: skip
    """The extents the manifest names that verify and are whole, to index; counts, removals,
    compaction and the log line as the module doc says."""
    try:
        entries = manifest.scan()
        result = sort_entries(client, names, ns, seal, entries)
        removed = drop_rejected(client, result.rejected)
    except Exception as e:  # the binding's own errors too: a warm start never stops the open
        report(Op.LOAD, e)
        return []
    finally:
        counters.add("manifest_bad_records", manifest.bad_records)
    compacted = None if result.unsure else _compact(manifest, [e for e in entries if e[0] in result.live],
                                                    counters, report)  # fmt: skip
    for name, n in (("scanned_extents", len(result.found)), ("newer_extents", result.newer),
                    ("warm_start_gone", result.gone), ("removed_bad_files", removed)):  # fmt: skip
        counters.add(name, n)
    if entries or manifest.bad_records:
        _log(result, removed, manifest.bad_records, compacted)
    return result.found


def _compact(manifest: Manifest, live: list[Entry], counters: Counters, report: Report) -> Compaction | None:
    try:
        done = manifest.compact(live)
    except Exception as e:  # as above: a compaction never stops the open
        counters.add("io_errors")
        report(Op.STORE, e)
        return None
    if done is not None:
        counters.add("manifest_compactions")
        counters.add("manifest_records_removed", done.removed)
    return done


def _log(result: Sorted, removed: int, bad_records: int, compacted: Compaction | None) -> None:
    level = logging.WARNING if result.rejected or bad_records else logging.INFO
    logger.log(
        level,
        "sgl_hicache: warm start from the Mooncake Store's manifest: %d extents found; %d gone (evicted, "
        "removed or purged since), %d rejected (headers that did not verify; %d removed), %d of a newer "
        "version (kept), %d unanswered; %d manifest records did not verify (another secret, tampered)%s",
        len(result.found), result.gone, len(result.rejected), removed, result.newer, result.unsure, bad_records,
        "" if compacted is None else f"; compacted: {compacted.removed} records removed, "
        f"{compacted.written} written",
    )  # fmt: skip
