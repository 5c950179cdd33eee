"""Who is writing: a writer identity that stays meaningful across hosts, containers and reboots.

A pid alone names a process only on one host, in one pid namespace, until the pid is reused: a
temp file of another host (a shared NVMe-oF / NFS directory), of another container, or of our own
previous life (a container restarted with the same pid) must not be judged by `kill(pid, 0)` here.
So a writer is `<pid>-<start>-<host>`:

- `pid`: the writer's pid in its own pid namespace;
- `start`: its start time in clock ticks since boot (/proc/<pid>/stat field 22), which tells a
  reused pid from the writer (0 where /proc is not available);
- `host`: 16 hex digits of BLAKE2b over hostname, boot id (/proc/sys/kernel/random/boot_id) and
  pid namespace (readlink /proc/self/ns/pid), so a reboot or another container is another host.

`liveness` answers only for a writer of our host: ALIVE or DEAD. For any other it is UNKNOWN, and
callers fall back to the age of the writer's files (scan.py) or of its lease (ledger.py).
"""

from __future__ import annotations

import enum
import hashlib
import os
import socket
from dataclasses import dataclass
from functools import cache

HOST_HEX = 16


class Liveness(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"  # another host, boot or pid namespace: only age can tell


@dataclass(frozen=True)
class Writer:
    pid: int
    start: int
    host: str

    @property
    def token(self) -> str:
        """The form used in temp file names and the ledger: no dots, no spaces."""
        return f"{self.pid}-{self.start}-{self.host}"

    @classmethod
    def parse(cls, token: str) -> Writer | None:
        """The writer a token names, or None if it is not one (a foreign or pre-identity name)."""
        parts = token.split("-")
        if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
            return None
        if len(parts[2]) != HOST_HEX or any(c not in "0123456789abcdef" for c in parts[2]):
            return None
        return cls(int(parts[0]), int(parts[1]), parts[2])


def me() -> Writer:
    """This process (recomputed after a fork: the pid is part of the cache key)."""
    return _me(os.getpid())


@cache
def _me(pid: int) -> Writer:
    return Writer(pid, start_ticks(pid) or 0, host_tag())


@cache
def host_tag() -> str:
    """BLAKE2b-64 of hostname, boot id and pid namespace: what makes a local pid meaningful."""
    parts = [socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), _readlink("/proc/self/ns/pid")]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=HOST_HEX // 2).hexdigest()


def liveness(writer: Writer) -> Liveness:
    """ALIVE or DEAD for a writer of this host (pid gone, or reused by a later process); else UNKNOWN."""
    if writer.host != host_tag():
        return Liveness.UNKNOWN
    if writer == me():
        return Liveness.ALIVE
    if not _pid_exists(writer.pid):
        return Liveness.DEAD
    start = start_ticks(writer.pid)
    if start is not None and writer.start and start != writer.start:
        return Liveness.DEAD  # the pid now names a later process
    return Liveness.ALIVE


def start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if unknown (no /proc, no such pid)."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _pid_exists(pid: int) -> bool:
    if pid <= 0:
        return False  # kill(0 or -n) would signal a process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
