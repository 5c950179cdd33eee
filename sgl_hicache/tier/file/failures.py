"""What a failed job of the file backend leaves: its status (a file removed behind our back is a
clean MISS, a newer format's file a MISS kept on disk), counted, logged (rate-limited), and the bad
extent dropped, or the gone one forgotten."""

from __future__ import annotations

import errno

from sgl_hicache.tier.faults import classify, logger
from sgl_hicache.tier.file.budget.index import Entry
from sgl_hicache.tier.file.budget.process import ProcessBudget
from sgl_hicache.tier.format import FormatError, NewerFormat
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.results import Completion, Op, Status, Ticket

COUNTER_OF = {
    Status.MISS: "misses", Status.CORRUPT: "checksum_failures", Status.MISMATCH: "mismatches",
    Status.NO_SPACE: "no_space",
}  # fmt: skip


def failed(
    budget: ProcessBudget, op: Op, ticket: Ticket, key: ExtentKey, err: Exception, seen: Entry | None = None
) -> Completion:
    """Count, log (rate-limited) and clean up after a failed job; returns its completion. A
    failed load cleans up only what it saw: `seen` (the key's index entry when it began) is
    forgotten or dropped, never an extent a store published while the load ran. A file of a
    newer format version is a MISS (forgotten, kept on disk: its writer's), never corrupt."""
    newer = isinstance(err, NewerFormat)
    status = Status.MISS if newer or (op is Op.LOAD and gone(err)) else classify(op, err)
    budget.counters.add("newer_extents" if newer else COUNTER_OF.get(status, "io_errors"))
    if not isinstance(err, (OSError, FormatError)):
        logger.error("spill tier %s job failed unexpectedly", op.value, exc_info=err)
    elif status in (Status.IO_ERROR, Status.NO_SPACE):
        budget.faults.report(op, err, str(budget.paths.ns_dir))
    if status in (Status.CORRUPT, Status.MISMATCH):
        if op is Op.LOAD:
            budget.drop_if(key, seen)
        else:
            budget.drop(key)
    elif status is Status.MISS and seen is not None:  # removed behind our back (another process)
        with budget.lock:
            forgotten = budget.index.remove_if(key, seen)
        if forgotten:
            budget.shared.saw_others()
    return Completion(ticket, op, key, status, 0, str(err))


def gone(err: Exception) -> bool:
    """A file removed by another process: ENOENT at open, ESTALE on NFS when another host unlinked it."""
    return isinstance(err, OSError) and err.errno in (errno.ENOENT, errno.ESTALE)
