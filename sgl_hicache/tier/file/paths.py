"""Where extents live: `<dir>/<namespace id hex>/<ab>/<key hex>.ext` (`ab`: first byte of the key).

One fan-out level of 256 directories: ~400 files per directory at 100k extents, ~40k at 10M (fine
for ext4/xfs hashed directories), while a second level would create up to 65,536 nearly empty
directories whose cold reads dominate the startup scan.

Names carry hashes only, never prompt text. Directories are 0700 and files 0600; the root and the
namespace directory are checked to be ours before use (trust.py), and re-created with the same
checks if removed while in use (`recreate`). Temp files sit beside their target as
`.<key hex>.<writer>.<random>.tmp`, where `<writer>` is `owner.Writer.token` (pid, start time, and a
tag of host, boot and pid namespace), so a scan can tell a live writer's temp file from a stale one
on any host (scan.py), and a closing tier can find its own (`own_temps`).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path

from sgl_hicache.tier.file.owner import Writer, me
from sgl_hicache.tier.format import EXTENT_SUFFIX, TEMP_SUFFIX
from sgl_hicache.tier.keys import ExtentKey, NamespaceId
from sgl_hicache.tier.trust import Reopened, open_trusted, reopen_trusted

ALIAS_DIR = "aliases"  # in a namespace directory: the alias links of cross-server lookups (aliases.py)
DIR_MODE = 0o700
FANOUT_CHARS = 2
FILE_MODE = 0o600


class ExtentPaths:
    def __init__(self, root: Path, namespace: NamespaceId) -> None:
        self.root = Path(root)
        self.ns_dir = self.root / namespace.hex()
        self.device = -1  # st_dev of the root, once created or checked

    def create_root(self) -> bytes:
        """Create or check the root and namespace directory (`trust.open_trusted`), create the 256
        fan-out directories (mode 0700), so stores do not pay for (journaled) directory creation,
        and return the root's secret. Raises UntrustedDirectory, OSError."""
        secret = open_trusted(self.root, self.ns_dir.name)
        self.device = os.stat(self.root).st_dev
        self._create_fanout()
        return secret

    def recreate(self, secret: bytes) -> Reopened:
        """Re-create whatever of the root (with `secret`), the namespace directory and the fan-out
        directories was removed (`trust.reopen_trusted`: same checks, same volume as at open).
        Raises UntrustedDirectory, OSError."""
        reopened = reopen_trusted(self.root, self.ns_dir.name, secret, self.device)
        self._create_fanout()
        return reopened

    def _create_fanout(self) -> None:
        for i in range(16**FANOUT_CHARS):
            with contextlib.suppress(FileExistsError):
                (self.ns_dir / f"{i:0{FANOUT_CHARS}x}").mkdir(mode=DIR_MODE)

    def extent(self, key: ExtentKey) -> Path:
        h = key.hex()
        return self.ns_dir / h[:FANOUT_CHARS] / f"{h}{EXTENT_SUFFIX}"

    def temp_for(self, key: ExtentKey) -> Path:
        """A fresh temp path beside `key`'s file, creating the fan-out directory (not the root)."""
        final = self.extent(key)
        with contextlib.suppress(FileExistsError):
            final.parent.mkdir(mode=DIR_MODE)
        return final.parent / f".{key.hex()}.{me().token}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"

    def own_temps(self, keys: Iterable[ExtentKey]) -> list[Path]:
        """This process's temp files for `keys` (being written, or left by an abandoned write)."""
        by_dir: dict[Path, set[str]] = {}
        for key in keys:
            by_dir.setdefault(self.extent(key).parent, set()).add(key.hex())
        return [
            Path(de.path) for fanout, hexes in by_dir.items() for de in _scandir(fanout)
            if temp_writer(de.name) == me() and de.name.split(".")[1] in hexes
        ]  # fmt: skip

    def walk(self) -> Iterator[os.DirEntry[str]]:
        """Every file in the namespace directory and its fan-out directories (missing dirs: none);
        never the alias links (`aliases.py`), which are not extents and hold no budget bytes."""
        for part in self.parts():
            yield from part()

    def parts(self) -> list[Callable[[], list[os.DirEntry[str]]]]:
        """The walk split into independent pieces (one per top-level fan-out dir) for parallel scans."""
        entries = _scandir(self.ns_dir)
        loose = [de for de in entries if not de.is_dir(follow_symlinks=False)]
        tops = [Path(de.path) for de in entries if de.is_dir(follow_symlinks=False) and de.name != ALIAS_DIR]
        return [lambda: loose, *(partial(_files, top, 0) for top in tops)]


def _files(path: Path, depth: int) -> list[os.DirEntry[str]]:
    out: list[os.DirEntry[str]] = []
    for de in _scandir(path):
        if not de.is_dir(follow_symlinks=False):
            out.append(de)
        elif depth > 0:
            out += _files(Path(de.path), depth - 1)
    return out


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def temp_writer(name: str) -> Writer | None:
    """The writer a temp file's name records, or None if it records none (not one of ours, or
    written before writers had an identity: such a file is judged by its age alone)."""
    parts = name.split(".")
    if len(parts) == 5 and parts[4] == TEMP_SUFFIX[1:]:
        return Writer.parse(parts[2])
    return None


def free_bytes(directory: Path) -> int | None:
    """Bytes available on `directory`'s volume; None if it reports no size (ramfs).

    Raises OSError (e.g. the directory was removed)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize if st.f_blocks else None
