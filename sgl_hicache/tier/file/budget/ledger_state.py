"""The shared budget's small types: the ledger file's content (`State`, its checksummed text
encoding, docs/DESIGN.md "Sharing a tier"), what a reservation returns (`Reserved`) and what it
calls back (`LedgerClient`). `ledger.Ledger` keeps them in `<root>/.budget` under a POSIX lock."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import xxhash

from sgl_hicache.tier.file.owner import Writer
from sgl_hicache.tier.file.paths import temp_writer

MAGIC = "sgl-hicache-budget 1"
MAX_LEDGER_BYTES = 64 << 10  # ~1000 leases; a larger file is torn or foreign: recounted


@dataclass
class Lease:
    nbytes: int
    updated: float


@dataclass
class State:
    published: int = 0
    leases: dict[str, Lease] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.published + sum(lease.nbytes for lease in self.leases.values())

    def encode(self) -> bytes:
        lines = [MAGIC, f"published {self.published}"]
        lines += [f"lease {t} {lease.nbytes} {lease.updated:.3f}" for t, lease in sorted(self.leases.items())]
        body = "\n".join(lines) + "\n"
        return (body + f"sum {xxhash.xxh3_64_hexdigest(body.encode())}\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> State | None:
        """The state written by `encode`, or None for anything else (empty, torn, foreign)."""
        text = data.decode("ascii", errors="replace")
        body, _, tail = text.rpartition("sum ")
        lines = body.splitlines()
        if tail.strip() != xxhash.xxh3_64_hexdigest(body.encode()) or lines[:1] != [MAGIC] or len(lines) < 2:
            return None
        try:
            state = cls(int(lines[1].removeprefix("published ")))
            for line in lines[2:]:
                _, token, nbytes, updated = line.split(" ")
                if Writer.parse(token) is not None:
                    state.leases[token] = Lease(int(nbytes), float(updated))
        except ValueError:
            return None
        return state


def leased(path: str, state: State) -> bool:
    """A temp file whose writer holds a lease: its bytes are in the lease, not in `published`."""
    writer = temp_writer(os.path.basename(path))
    return writer is not None and writer.token in state.leases


class LedgerClient(Protocol):
    """What a reservation needs from its caller: the budget it must fit, evicting, and counting
    what the ledger removed."""

    @property
    def capacity_bytes(self) -> int:
        """The byte budget to lease within (the caller's: asked once per reservation)."""

    def evict(self, short: int) -> int:
        """Called with the ledger locked: unlink extents until `short` bytes are freed; the bytes freed."""

    def removed_temps(self, count: int) -> None:
        """`count` stale temp files were removed (accounted)."""

    def unlink_failed(self, error: OSError) -> None:
        """A stale temp file could not be removed (it stays counted; the next sweep tries again)."""


class Reserved(NamedTuple):
    generation: int  # the ledger file the bytes are leased in: give it back to commit/release/retract
    pressed: bool  # the reservation had to evict
