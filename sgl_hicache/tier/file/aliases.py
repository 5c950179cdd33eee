"""Aliases: where another writer's extent continues a token path, found by the path's key.

An extent's key depends on where its writer split its radix tree (it names the path before the
extent and the extent's own tokens, keys.py), so a server that split the same tokens elsewhere cannot
compute it. Path keys do not depend on splits: every extent records, in its MAC'd meta, the writer's
path keys at block-aligned positions inside it and at its end (`format.Alias`), and publishes one
alias per recorded key:

    <namespace dir>/aliases/<ab>/<path key hex>   a symbolic link whose target is the text
                                                  "<extent key hex>.<offset>" (never followed)

An alias is only a pointer to check: a reader parses the target strictly, opens the extent by its
key, verifies the header like a load (MACs, key), and accepts the claim only if the header's
recorded alias at that offset is the path key it computed from its own tokens (path_lookup.py). A later
writer of the same key replaces the link (`os.replace`, atomic): any of them is a valid claim.

Dangling aliases (their extent gone) are removed: by the process that unlinks an extent (it reads
the aliases the file's meta records just before the unlink, `recorded`, and removes them after it,
`unlink_aliases`), and by a lookup that meets one (`remove_dangling`). Only a link that still names
the gone extent is removed, and only while that extent is still absent: the link is first moved
aside (atomic), checked again, and put back if it changed meanwhile, never over a newer claim. The
aliases read from a file are not checked against the MACs: they only say which links to look at,
and a link is removed only if it points at an extent that does not exist, which no lookup could
use. An alias is left behind where its extent disappears otherwise (a crash between the unlink and
the sweep, a file removed by hand or by `fsck --repair`, a file whose meta does not decode, a root
removed): it stays until a lookup meets it or a writer claims its path key again.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Sequence
from pathlib import Path

from sgl_hicache.tier.file.paths import ALIAS_DIR, DIR_MODE, FANOUT_CHARS, ExtentPaths
from sgl_hicache.tier.format import (
    EXTENT_SUFFIX,
    FIXED_SIZE,
    Alias,
    FormatError,
    decode_aliases,
    decode_fixed,
)
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.path_lookup import parse_claim

_EXTENT = re.compile(r"([0-9a-f]{32})" + re.escape(EXTENT_SUFFIX))


def alias_path(paths: ExtentPaths, path_key: bytes) -> Path:
    return _alias_at(paths.ns_dir, path_key)


def _alias_at(ns_dir: Path, path_key: bytes) -> Path:
    h = path_key.hex()
    return ns_dir / ALIAS_DIR / h[:FANOUT_CHARS] / h


def write_aliases(paths: ExtentPaths, key: ExtentKey, aliases: Sequence[Alias]) -> int:
    """Publish one alias per entry (after the extent itself is published); returns how many.
    Raises OSError (the extent stays valid: it is only not findable by lookup)."""
    for alias in aliases:
        final = alias_path(paths, alias.path_key)
        target = f"{key.hex()}.{alias.offset}"
        try:
            os.symlink(target, final)
        except FileNotFoundError:  # first alias in this fan-out directory
            for d in (final.parent.parent, final.parent):
                with contextlib.suppress(FileExistsError):
                    d.mkdir(mode=DIR_MODE)
            _replace(target, final)
        except FileExistsError:  # another extent claims the same path: the newest claim wins
            _replace(target, final)
    return len(aliases)


def _replace(target: str, final: Path) -> None:
    tmp = final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    os.symlink(target, tmp)
    try:
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_alias(paths: ExtentPaths, path_key: bytes) -> tuple[ExtentKey, int] | None:
    """(extent key, offset) the alias of `path_key` claims, or None: no alias, or not one of ours
    (not a link, or a target that is not exactly "<32 hex>.<digits>"). One readlink."""
    return _claim(alias_path(paths, path_key))


def _claim(link: Path) -> tuple[ExtentKey, int] | None:
    try:
        target = os.readlink(link)
    except OSError:
        return None
    return parse_claim(target)


def recorded(extent: str) -> tuple[bytes, ...]:
    """The path keys extent file `extent` records in its meta (read without checking the MACs: see
    the module doc); none if it cannot be read. Read it before unlinking the file (an unlinked file
    kept open would keep its blocks on the volume). Never raises."""
    try:
        fd = os.open(extent, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ()
    try:
        header = decode_fixed(os.pread(fd, FIXED_SIZE, 0), None)
        meta = os.pread(fd, FIXED_SIZE + header.meta_len, 0)
        return tuple(a.path_key for a in decode_aliases(header, meta, None))
    except (OSError, FormatError):
        return ()
    finally:
        os.close(fd)


def unlink_aliases(extent: str, path_keys: Sequence[bytes]) -> int:
    """Remove the aliases of `path_keys` (what extent file `extent` recorded, `recorded`) that still
    name it, now that it is unlinked; returns how many. Never raises: an alias left behind only
    dangles until a lookup meets it."""
    m = _EXTENT.fullmatch(os.path.basename(extent))
    if m is None:
        return 0
    ns_dir, key = Path(extent).parent.parent, ExtentKey(bytes.fromhex(m[1]))
    return sum(remove_dangling(ns_dir, path_key, key) for path_key in path_keys)


def remove_dangling(ns_dir: Path, path_key: bytes, key: ExtentKey) -> bool:
    """Remove the alias of `path_key` in namespace directory `ns_dir` if it names extent `key` and
    that extent's file is absent; whether it was removed. Never raises."""
    link = _alias_at(ns_dir, path_key)
    extent = ns_dir / key.hex()[:FANOUT_CHARS] / f"{key.hex()}{EXTENT_SUFFIX}"
    claim = _claim(link)
    if claim is None or claim[0] != key or os.path.lexists(extent):
        return False
    aside = link.parent / f".{link.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.gone"
    try:
        os.rename(link, aside)
    except OSError:
        return False  # gone already, or not ours to move
    claim = _claim(aside)
    with contextlib.suppress(OSError):
        if claim is not None and claim[0] == key and not os.path.lexists(extent):
            os.unlink(aside)
            return True
        with contextlib.suppress(FileExistsError):  # a newer claim was published meanwhile: keep it
            os.link(aside, link, follow_symlinks=False)
        os.unlink(aside)
    return False
