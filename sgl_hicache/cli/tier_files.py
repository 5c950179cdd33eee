"""Finding a tier's namespaces and sorting their files by role, from the directory alone."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sgl_hicache.tier.file.paths import FANOUT_CHARS, ExtentPaths
from sgl_hicache.tier.file.scan import is_stale_temp
from sgl_hicache.tier.format import EXTENT_SUFFIX, TEMP_SUFFIX, DirectoryMac
from sgl_hicache.tier.keys import KEY_BYTES, ExtentKey, NamespaceId
from sgl_hicache.tier.trust import SECRET_NAME, UntrustedDirectory, read_secret

_HEX_NAME = 2 * KEY_BYTES


class UsageError(Exception):
    """DIR is missing or not a tier directory; the message is one line."""


@dataclass
class NsFiles:
    """The files of one namespace directory, sorted by role."""

    ns: NamespaceId
    path: Path
    extents: list[os.DirEntry[str]] = field(default_factory=list)
    stale_temps: list[str] = field(default_factory=list)
    live_temps: list[str] = field(default_factory=list)


def namespace_dirs(root: Path) -> list[Path]:
    """The namespace directories of tier `root`; raises UsageError if it is not a tier directory."""
    if not root.is_dir():
        raise UsageError(f"{root}: {'not a directory' if root.exists() else 'no such directory'}")
    try:
        found = sorted(p for p in root.iterdir() if p.is_dir() and _is_hex(p.name, _HEX_NAME))
    except OSError as e:
        raise UsageError(f"{root}: {e.strerror}") from None
    if found:
        return found
    if _is_hex(root.name, _HEX_NAME):
        raise UsageError(f"{root}: looks like a namespace directory; pass the tier directory above it")
    raise UsageError(f"{root}: not a tier directory (no namespace directories)")


def directory_seal(root: Path) -> tuple[DirectoryMac | None, str]:
    """The seal of tier `root` (from its secret, which must belong to the directory's owner) and a
    note saying whether MACs are verified; without a readable secret (another user), they are not."""
    secret = root / SECRET_NAME
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return DirectoryMac(read_secret(fd, root, os.fstat(fd).st_uid)), f"MACs verified with {secret}"
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None, f"MACs NOT verified: no {secret} (a server would drop every extent)"
    except UntrustedDirectory as e:
        return None, f"MACs NOT verified: {e}"
    except OSError as e:
        return None, f"MACs NOT verified: cannot read {secret}: {e.strerror}"


def classify(ns_dir: Path, now: float) -> NsFiles:
    """Walk one namespace directory (as the tier's scan does) and sort its files."""
    files = NsFiles(NamespaceId(bytes.fromhex(ns_dir.name)), ns_dir)
    for de in ExtentPaths(ns_dir.parent, files.ns).walk():
        try:
            if de.name.endswith(EXTENT_SUFFIX):
                files.extents.append(de)
            elif de.name.endswith(TEMP_SUFFIX):
                (files.stale_temps if is_stale_temp(de, now) else files.live_temps).append(de.path)
        except FileNotFoundError:
            continue  # removed meanwhile by a server sharing the directory
    files.extents.sort(key=lambda de: de.name)
    return files


def key_of(de: os.DirEntry[str]) -> ExtentKey | None:
    """The key an extent file's name gives it, or None if misnamed or not in its fan-out directory
    (loads go by key to `<ab>/<key>.ext`, so such a file is never read)."""
    stem = de.name.removesuffix(EXTENT_SUFFIX)
    if not _is_hex(stem, _HEX_NAME) or Path(de.path).parent.name != stem[:FANOUT_CHARS]:
        return None
    return ExtentKey(bytes.fromhex(stem))


def _is_hex(name: str, length: int) -> bool:
    return len(name) == length and all(c in "0123456789abcdef" for c in name)
