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
recorded alias at that offset is the path key it computed from its own tokens (lookup.py). A later
writer of the same key replaces the link (`os.replace`, atomic): any of them is a valid claim. An
alias whose extent was evicted dangles; a lookup that meets it sees a clean miss.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Sequence
from pathlib import Path

from sgl_hicache.tier.format import Alias
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.paths import ALIAS_DIR, DIR_MODE, FANOUT_CHARS, ExtentPaths

_TARGET = re.compile(r"([0-9a-f]{32})\.([0-9]{1,10})")


def alias_path(paths: ExtentPaths, path_key: bytes) -> Path:
    h = path_key.hex()
    return paths.ns_dir / ALIAS_DIR / h[:FANOUT_CHARS] / h


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
    try:
        target = os.readlink(alias_path(paths, path_key))
    except OSError:
        return None
    m = _TARGET.fullmatch(target)
    return None if m is None else (ExtentKey(bytes.fromhex(m[1])), int(m[2]))
