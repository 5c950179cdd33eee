"""The Mooncake tier's loads (`MooncakeTier.submit_load`), read layer group by layer group.

A load's first job, ranked (batch, 0) on the tier's `IoScheduler` (batch: the load's own ticket or
the earlier one it was submitted with, as the file tier ranks its reads), reads and verifies the
header, plans the load (`codec.plan_load`), queues one job per further layer group ranked (batch,
group) and reads group 0 itself: so the loads of one batch read every group 0 before any group 1,
and a later batch after them. A group's chunks go in batch reads of up to
`objects.LOAD_BATCH_BYTES` (`objects.read_pieces`), each chunk verified before its bytes count.
Groups finish in any order; `landed` is the verified byte prefix (`progress.LoadProgress`; nothing
before the end for a load that rearranges its bytes). The job that finishes last ends the load: an
OK completion, or the first error, classified by the tier. A group job that starts after the load
failed reads nothing. Every job of a load runs under `Returned.guard`, so one that raises still ends
the load (IO_ERROR, counted); a group job raises only from the load's end (its reads' errors are the
load's, its runs planned before any job was queued): no completion is posted while another job of
the load may still write its destination.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import NamedTuple

from sgl_hicache.tier.base import Op, Ticket
from sgl_hicache.tier.codec import Plan, plan_load
from sgl_hicache.tier.completions import Returned
from sgl_hicache.tier.format import DirectoryMac, FormatError
from sgl_hicache.tier.groups import section_of
from sgl_hicache.tier.keys import ExtentKey, NamespaceId
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.mooncake.client import Names, StoreClient
from sgl_hicache.tier.progress import LoadProgress
from sgl_hicache.tier.scheduler import IoScheduler


class Reader(NamedTuple):
    """Where a tier's extents are read from: its client, names, namespace, seal and scratch."""

    client: StoreClient
    names: Names
    ns: NamespaceId
    seal: DirectoryMac
    scratch: objects.Scratch

    def open(self, key: ExtentKey, salt: bytes | None) -> objects.Opened:
        return objects.open_header(self.client, self.names, self.ns, key, salt, self.seal, self.scratch)


class Ends(NamedTuple):
    """What the tier does with a load (it owns the index, the counters and the completions)."""

    salt: Callable[[ExtentKey], bytes | None]
    """The salt tag `key`'s objects are found under (its index's, else None)."""
    rejected: Callable[[Ticket, ExtentKey, str], None]
    """Post a REJECTED completion (the request cannot be served; nothing is wrong with the extent)."""
    failed: Callable[[Ticket, ExtentKey, bytes | None, Exception, objects.Opened | None], None]
    """Classify a failure (with the header the load verified, if it got that far) and post it."""
    loaded: Callable[[Ticket, objects.Opened, int], None]
    """Record an OK load of the extent and its bytes, and post its completion."""


class MooncakeLoad(LoadProgress):
    """A load whose header was verified and planned: its pieces by layer group (`groups`: group ->
    indices into `pieces`, in order), one job a group, which reads the group's `runs` (one batch
    read each); `key`'s objects are under the salt tag `ext.salt`."""

    def __init__(self, ticket: Ticket, key: ExtentKey, ext: objects.Opened, dest: memoryview, want: int,
                 plan: Plan, chunk_names: list[str]) -> None:  # fmt: skip
        super().__init__(plan, want)
        self.ticket, self.key, self.ext, self.dest, self.chunk_names = ticket, key, ext, dest, chunk_names
        self.groups: dict[int, list[int]] = {}
        for i, g in enumerate(section_of(ext.header.sections, [p.raw_off for p in plan.pieces])):
            self.groups.setdefault(g, []).append(i)
        self.runs = {g: list(self._runs(indices)) for g, indices in self.groups.items()}

    def _runs(self, indices: list[int]) -> Iterator[list[int]]:
        """`indices` in runs of at most `LOAD_BATCH_BYTES` of chunks (at least one)."""
        part: list[int] = []
        nbytes = 0
        for i in indices:
            n = self.ext.chunks[self.pieces[i].chunk].length
            if part and nbytes + n > objects.LOAD_BATCH_BYTES:
                yield part
                part, nbytes = [], 0
            part.append(i)
            nbytes += n
        if part:
            yield part


class Loads:
    """The load jobs of one tier: run on `io`, each under `returned.guard`; `returned.loading`
    (ticket -> its load, guarded by `lock`) is what the tier's `landed` reads, from the plan on
    until the completion is returned."""

    def __init__(self, reader: Reader, io: IoScheduler, lock: threading.Lock,
                 returned: Returned[LoadProgress], ends: Ends) -> None:  # fmt: skip
        self._reader, self._io, self._lock, self._ends = reader, io, lock, ends
        self._returned, self._loading = returned, returned.loading

    def job(self, ticket: Ticket, key: ExtentKey, dest: memoryview, nbytes: int | None,
            group_layers: int | None, batch: int) -> Callable[[], None]:  # fmt: skip
        """The load's first job (`open_job`), to queue ranked (batch, 0)."""
        opened = partial(self.open_job, ticket, key, dest, nbytes, group_layers, batch)
        return self._returned.guard(ticket, Op.LOAD, key, opened)

    def open_job(self, ticket: Ticket, key: ExtentKey, dest: memoryview, nbytes: int | None,
                 group_layers: int | None, batch: int) -> None:  # fmt: skip
        """The load's first job: the header, the plan, the further groups queued, group 0 read."""
        salt = self._ends.salt(key)
        try:
            ext = self._reader.open(key, salt)
        except Exception as e:
            self._ends.failed(ticket, key, salt, e, None)
            return
        want = ext.header.payload_len if nbytes is None else nbytes
        if want > dest.nbytes:
            self._ends.rejected(ticket, key, f"destination too small for {want} B")
            return
        try:
            plan = plan_load(ext.header, want, group_layers)
            load = MooncakeLoad(ticket, key, ext, dest, want, plan, ext.chunk_names(self._reader.names))
        except Exception as e:
            self._fail(ticket, key, ext, e)
            return
        with self._lock:
            self._loading[ticket] = load
        if not load.groups:
            self._end(load)
            return
        first, *later = sorted(load.groups)
        for group in later:  # ranked: the batch's group 0 first (the module doc)
            job = self._returned.guard(ticket, Op.LOAD, key, partial(self._group_job, load, group))
            self._io.submit_read(job, (batch, group))
        self._group_job(load, first)

    def _group_job(self, load: MooncakeLoad, group: int) -> None:
        for part in load.runs[group]:
            error = load.error  # once the load failed, nothing more is read
            if error is None:
                try:
                    pieces = [load.pieces[i] for i in part]
                    objects.read_pieces(self._reader.client, [load.chunk_names[p.chunk] for p in pieces],
                                        load.ext, pieces, load.dest, self._reader.scratch)  # fmt: skip
                except Exception as e:
                    error = e
            if load.done(part, error):
                self._end(load)

    def _end(self, load: MooncakeLoad) -> None:
        """The last job's: rearrange (if planned) and post the outcome."""
        error = load.error
        if error is None:
            try:
                load.finish(load.ext.header, load.dest)
            except Exception as e:
                error = e
        if error is None:
            self._ends.loaded(load.ticket, load.ext, load.want)
        else:
            self._fail(load.ticket, load.key, load.ext, error)

    def _fail(self, ticket: Ticket, key: ExtentKey, ext: objects.Opened, error: Exception) -> None:
        """After the header verified: a plain ValueError (a layer grouping this extent cannot be
        delivered in) is the request's (REJECTED); the rest the tier classifies."""
        if isinstance(error, ValueError) and not isinstance(error, FormatError):
            self._ends.rejected(ticket, key, str(error))
        else:
            self._ends.failed(ticket, key, ext.salt, error, ext)
