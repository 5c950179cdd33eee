"""The Mooncake tier's loads (`MooncakeTier.submit_load`): a batch's loads share their store calls.

Loads submitted with the same `batch` (the load's own ticket or the earlier one it was submitted
with, as the file tier ranks its reads) are read together: a load joins its batch's pending loads
(`_Batch`, guarded by the tier lock) and queues a job ranked (batch, 0) on the tier's
`IoScheduler`. A job takes everything of its batch pending for its rank when it runs (one that
finds nothing returns):

- rank (batch, 0): the headers of the batch's loads not opened yet, in one batch read
  (`objects.open_headers`), each verified and planned (`codec.plan_load`) on its own; their layer
  groups join the batch's pending groups, and the job reads group 0;
- rank (batch, group): that layer group's chunks across the batch's loads pending for it, in batch
  reads of up to `objects.LOAD_BATCH_BYTES` (`objects.read_pieces`).

A batch's layer groups are read one after another: the last of its running jobs, as it ends,
queues a job for the lowest group still pending (unless one is queued), so the calls of one batch
do not run at once (concurrent calls into the client slow each other down more than they overlap).
So a batch whose loads are all pending when its first job runs costs one call for the headers and
one a layer group; every group 0 is read before any group 1, and a later batch after it. A load
that needs no group order (`group_order` False: a restore that is not layer-wise) has all its
pieces in group 0 where the tier's `load_calls` is "merged" (the default, `MooncakeConfig`): a
batch of such loads costs two calls (the headers; every group's chunks, load by load, up to
`LOAD_BATCH_BYTES` a call) whatever its groups. "by_group" reads them group by group as well.

Per load nothing is shared: each reply is checked and each chunk verified on its own before
`landed` counts its bytes (the verified byte prefix, `progress.LoadProgress`; nothing before the
end for a load that rearranges its bytes); a missing or bad object fails its own load only (with
that load's other pieces of the call); a load failed earlier reads nothing more. A load one of
whose chunks read straight into its destination got a reply that the store gave up on the transfer
(`objects.written_late`) completes `dest_unsafe`, however it ends. The job that
records a load's last piece ends it: an OK completion, or the first error, classified by the tier
(`Ends`). The store's and the checks' errors are the loads' outcomes, never raised, so only a bug
raises, and it strands no load: one raising where loads are handled together (planning a call's
headers, a group's runs, a call's pieces) is the error of each load of that step (IO_ERROR; each
then reads nothing more), and each load's planning, recording and end run under its own ticket's
`Returned.guard` (a raise there fails that load alone, IO_ERROR, counted); every job, too, as a
last resort. No completion is posted while another job may still write the load's destination
(a transfer the store gave up on may: that completion says `dest_unsafe`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import NamedTuple

from sgl_hicache.tier.codec import Plan, plan_load
from sgl_hicache.tier.completions import Returned
from sgl_hicache.tier.format import DirectoryMac, FormatError
from sgl_hicache.tier.groups import section_of
from sgl_hicache.tier.keys import ExtentKey, NamespaceId
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.mooncake.client import Names, StoreClient
from sgl_hicache.tier.mooncake.scratch import SCRATCH_KEEP_BYTES, Scratch
from sgl_hicache.tier.progress import LoadProgress
from sgl_hicache.tier.results import Op, Ticket
from sgl_hicache.tier.scheduler import IoScheduler


class Reader(NamedTuple):
    """Where a tier's extents are read from: its client, names, namespace, seal and scratch."""

    client: StoreClient
    names: Names
    ns: NamespaceId
    seal: DirectoryMac
    scratch: Scratch

    def open(self, wanted: Sequence[tuple[ExtentKey, bytes | None]]) -> list[objects.Opened | Exception]:
        return objects.open_headers(self.client, self.names, self.ns, wanted, self.seal, self.scratch)


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
    indices into `pieces`, in order; `merged`: all of them in group 0); `key`'s objects are under
    the salt tag `ext.salt`."""

    def __init__(self, ticket: Ticket, key: ExtentKey, ext: objects.Opened, dest: memoryview, want: int,
                 plan: Plan, chunk_names: list[str], merged: bool = False, direct: bool = True) -> None:  # fmt: skip
        super().__init__(plan, want)
        self.ticket, self.key, self.ext, self.dest, self.chunk_names = ticket, key, ext, dest, chunk_names
        self.direct = direct  # the store copies into `dest` itself (`objects.PieceRead.direct`)
        self.ended = False  # its completion posted by a guard (a bug raised recording it)
        self.groups: dict[int, list[int]] = {}
        offsets = [p.raw_off for p in plan.pieces]
        for i, g in enumerate([0] * len(offsets) if merged else section_of(ext.header.sections, offsets)):
            self.groups.setdefault(g, []).append(i)

    def read(self, i: int) -> objects.PieceRead:
        """Piece `i` as one object of a batch read."""
        p = self.pieces[i]
        return objects.PieceRead(self.chunk_names[p.chunk], self.ext, p, self.dest, self.direct)


Part = tuple[MooncakeLoad, list[int]]
"""A load and some of its pieces (indices into its `pieces`)."""


class LoadBug(RuntimeError):
    """A bug raised where loads are handled together, each load's error: IO_ERROR (counted, logged),
    never taken for the request's own error (a plain ValueError is REJECTED: `Loads._fail`)."""


def bug(e: Exception) -> LoadBug:
    if isinstance(e, LoadBug):
        return e
    out = LoadBug(f"{type(e).__name__}: {e}")
    out.__cause__ = e
    return out


class _Opening(NamedTuple):
    """A load submitted whose header is not read yet."""

    ticket: Ticket
    key: ExtentKey
    dest: memoryview
    nbytes: int | None
    group_layers: int | None
    group_order: bool


class _Batch:
    """What of batch `number` waits for a job (guarded by the tier lock): `opening`, the loads whose
    header is not read yet; `groups`: group -> the loads whose pieces of that layer group are not
    read yet (never an empty list); `queued`: the groups a group job is queued for, not started;
    `jobs`: its jobs queued and not yet ended, `running` those started. An entry is added by a job,
    or with one queued after it, and the last running job that ends queues one for the lowest group
    pending (`Loads._chain`): a batch without jobs has nothing pending."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.opening: list[_Opening] = []
        self.groups: dict[int, list[MooncakeLoad]] = {}
        self.queued: set[int] = set()
        self.jobs = self.running = 0


def _runs(loads: list[MooncakeLoad], group: int) -> Iterator[list[Part]]:
    """The pieces of layer group `group` of `loads`, in order, in runs of at most `LOAD_BATCH_BYTES`
    of chunks, of which at most `SCRATCH_KEEP_BYTES` pass through the scratch buffer (compressed,
    or a prefix's part of a chunk), at least one piece a run."""
    run: list[Part] = []
    nbytes = spare = 0
    for load in loads:
        part: list[int] = []
        for i in load.groups[group]:
            n = load.ext.chunks[load.pieces[i].chunk].length
            s = 0 if load.read(i).whole else n
            if nbytes and (nbytes + n > objects.LOAD_BATCH_BYTES or spare + s > SCRATCH_KEEP_BYTES):
                yield [*run, (load, part)] if part else run
                run, part, nbytes, spare = [], [], 0, 0
            part.append(i)
            nbytes, spare = nbytes + n, spare + s
        run.append((load, part))
    if run:
        yield run


class Loads:
    """The load jobs of one tier (the module doc): run on `io`; `returned.loading` (ticket -> its
    load, guarded by `lock`) is what the tier's `landed` reads, from the plan on until the
    completion is returned."""

    def __init__(self, reader: Reader, io: IoScheduler, lock: threading.Lock,
                 returned: Returned[LoadProgress], ends: Ends, merge: bool) -> None:  # fmt: skip
        """`merge`: a load without group order reads all its groups with the batch's group 0."""
        self._reader, self._io, self._lock, self._ends, self._merge = reader, io, lock, ends, merge
        self._returned, self._loading = returned, returned.loading
        self._batches: dict[int, _Batch] = {}  # by number, while it has jobs

    def submit(self, ticket: Ticket, key: ExtentKey, dest: memoryview, nbytes: int | None,
               group_layers: int | None, batch: int, group_order: bool) -> None:  # fmt: skip
        """Queue the load with the loads of `batch` (its first job ranked (batch, 0)); call holding
        `lock`. Its completion is posted by the jobs."""
        b = self._batches.setdefault(batch, _Batch(batch))
        b.opening.append(_Opening(ticket, key, dest, nbytes, group_layers, group_order))
        self._queue(b, 0, ticket, key, self._open_job)

    def _queue(self, b: _Batch, group: int, ticket: Ticket, key: ExtentKey,
               run: Callable[[_Batch, int], None]) -> None:  # fmt: skip
        """Queue `run(b, group)` ranked (batch, group), guarded under `ticket`; holding `lock`."""
        b.jobs += 1
        job = self._returned.guard(ticket, Op.LOAD, key, partial(self._job, b, group, run))
        self._io.submit_read(job, (b.number, group))

    def _job(self, b: _Batch, group: int, run: Callable[[_Batch, int], None]) -> None:
        with self._lock:
            b.running += 1
        try:
            run(b, group)
        finally:
            with self._lock:
                b.jobs -= 1
                b.running -= 1
                self._chain(b)
                if not b.jobs and self._batches.get(b.number) is b:  # nothing pending: forgotten
                    del self._batches[b.number]

    def _chain(self, b: _Batch) -> None:
        """As a job of `b` ends (holding `lock`), the last of its jobs running: a job for its lowest
        layer group still pending, unless one is queued (the module doc: one group after another)."""
        if not b.running and b.groups and (group := min(b.groups)) not in b.queued:
            b.queued.add(group)
            load = b.groups[group][0]  # its ticket guards the job
            self._queue(b, group, load.ticket, load.key, self._group_job)

    def _open_job(self, b: _Batch, group: int) -> None:
        """The headers pending, planned, their layer groups pending; then `group` (0) read."""
        with self._lock:
            opening, b.opening = b.opening, []
        loads = self._open(opening) if opening else []
        with self._lock:
            for load in loads:
                for g in load.groups:
                    b.groups.setdefault(g, []).append(load)
        self._read_group(b, group)

    def _group_job(self, b: _Batch, group: int) -> None:
        with self._lock:
            b.queued.discard(group)
        self._read_group(b, group)

    def _open(self, opening: list[_Opening]) -> list[MooncakeLoad]:
        """The headers of `opening` read (one batch read) and planned: the loads planned with
        pieces to read; every other one ended."""
        salts: list[bytes | None] = [None] * len(opening)
        try:
            salts = [self._ends.salt(o.key) for o in opening]
            got = self._reader.open([(o.key, salt) for o, salt in zip(opening, salts, strict=True)])
            if len(got) != len(opening):
                raise LoadBug(f"{len(got)} headers read for {len(opening)} loads")
        except Exception as e:  # the binding raised, or a bug: no header of the call was read
            got = [e] * len(opening)
        planned: list[MooncakeLoad] = []
        for o, salt, ext in zip(opening, salts, got, strict=True):
            self._guarded(o.ticket, o.key, partial(self._plan, o, salt, ext, planned))
        return planned

    def _plan(self, o: _Opening, salt: bytes | None, ext: objects.Opened | Exception,
              planned: list[MooncakeLoad]) -> None:  # fmt: skip
        """One load's header (or what failed it): planned into `planned`, or ended."""
        if isinstance(ext, Exception):
            self._ends.failed(o.ticket, o.key, salt, ext, None)
            return
        want = ext.header.payload_len if o.nbytes is None else o.nbytes
        if want > o.dest.nbytes:
            self._ends.rejected(o.ticket, o.key, f"destination too small for {want} B")
            return
        try:
            plan = plan_load(ext.header, want, o.group_layers)
            merged = self._merge and not o.group_order
            names, direct = ext.chunk_names(self._reader.names), self._reader.client.addressable(o.dest)
            load = MooncakeLoad(o.ticket, o.key, ext, o.dest, want, plan, names, merged, direct)
        except Exception as e:
            self._fail(o.ticket, o.key, ext, e)
            return
        with self._lock:
            self._loading[o.ticket] = load
        if load.groups:
            planned.append(load)
        else:
            self._end(load)

    def _read_group(self, b: _Batch, group: int) -> None:
        """`group`'s pieces of the loads pending for it, a run a call. A bug raising here fails
        the pieces it was to read (each load then reads nothing more): it strands no load."""
        with self._lock:
            loads = b.groups.pop(group, [])
        try:
            runs = list(_runs(loads, group))
        except Exception as e:
            self._record([(load, load.groups.get(group, [])) for load in loads], [bug(e)] * len(loads))
            return
        for run in runs:
            self._record(run, self._read_run(run))

    def _read_run(self, run: list[Part]) -> list[Exception | None]:
        """One batch read of `run`'s pieces; per part its outcome: its load's earlier error (then
        nothing of it is read), else the first error of its pieces, or None."""
        try:
            failed = [load.error for load, _ in run]
            errors = iter(
                self._read([part for part, error in zip(run, failed, strict=True) if error is None])
            )
            return [error if error is not None else next(errors) for error in failed]
        except Exception as e:  # a bug (the store's errors are outcomes): every part fails with it
            return [bug(e)] * len(run)

    def _record(self, parts: list[Part], errors: list[Exception | None]) -> None:
        """Each part's outcome recorded under its load's guard, and the loads it was the last of
        ended: the OK parts first (a failure's classification may call the store)."""
        outcomes = sorted(zip(parts, errors, strict=True), key=lambda outcome: outcome[1] is not None)
        for (load, indices), error in outcomes:
            self._guarded(load.ticket, load.key, partial(self._done, load, indices, error))

    def _done(self, load: MooncakeLoad, indices: list[int], error: Exception | None) -> None:
        if load.ended:  # a bug recording it ended it: its later parts have nothing to record
            return
        try:
            last = load.done(indices, error)
        except Exception as e:  # a bug: the guard ends the load (IO_ERROR) and it reads nothing more
            load.fail(e)
            load.ended = True
            raise
        if last:
            self._end(load)

    def _read(self, parts: list[Part]) -> list[Exception | None]:
        """The pieces of `parts` in one batch read; per part the first error of its pieces, or None."""
        if not parts:
            return []
        reads = [load.read(i) for load, indices in parts for i in indices]
        try:
            per_piece = objects.read_pieces(self._reader.client, reads, self._reader.scratch)
        except Exception as e:  # the binding raised: no piece of the call was read
            per_piece = [e] * len(reads)
        loads = [load for load, indices in parts for _ in indices]
        for load, r, error in zip(loads, reads, per_piece, strict=True):
            if objects.written_late(r, error):  # before its end is posted
                self._returned.dest_unsafe(load.ticket)
        out, at = [], 0
        for _, indices in parts:
            out.append(next((e for e in per_piece[at : at + len(indices)] if e is not None), None))
            at += len(indices)
        return out

    def _guarded(self, ticket: Ticket, key: ExtentKey, fn: Callable[[], None]) -> None:
        """`fn`, which ends load `ticket` or leaves it to later jobs, under the load's own guard."""
        self._returned.guard(ticket, Op.LOAD, key, fn)()

    def _end(self, load: MooncakeLoad) -> None:
        """After its last piece: rearrange (if planned) and post the outcome, under its guard."""
        self._guarded(load.ticket, load.key, partial(self._finish, load))

    def _finish(self, load: MooncakeLoad) -> None:
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
