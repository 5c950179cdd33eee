"""Lookups in a tier directory: aliases as symbolic links, extents as files (`path_lookup.ExtentSource`)."""

from __future__ import annotations

import os

from sgl_hicache.tier.file.aliases import read_alias, remove_dangling
from sgl_hicache.tier.file.load import open_extent
from sgl_hicache.tier.file.paths import ExtentPaths
from sgl_hicache.tier.format import DirectoryMac
from sgl_hicache.tier.keys import ExtentKey, NamespaceId
from sgl_hicache.tier.path_lookup import Claimed, run_lookup_in
from sgl_hicache.tier.results import LookupRequest, LookupResult


class FileSource:
    """Aliases as symbolic links and extents as files of a tier directory (aliases.py, load.py)."""

    def __init__(self, paths: ExtentPaths, ns: NamespaceId, seal: DirectoryMac) -> None:
        self.paths, self.ns, self.seal = paths, ns, seal

    def alias(self, path_key: bytes) -> tuple[ExtentKey, int] | None:
        return read_alias(self.paths, path_key)

    def aliases(self, path_keys: list[bytes]) -> list[tuple[ExtentKey, int] | None] | None:
        return None  # a readlink each: no cheaper at once

    def header(self, key: ExtentKey) -> Claimed:
        ext = open_extent(self.paths.extent(key), self.ns, key, False, self.seal)
        os.close(ext.fd)
        return Claimed(ext.header.parent, ext.header.token_count, ext.aliases, ext.tokens)

    def remove_dangling(self, path_key: bytes, key: ExtentKey) -> None:
        remove_dangling(self.paths.ns_dir, path_key, key)


def run_lookup(
    req: LookupRequest, paths: ExtentPaths, ns: NamespaceId, seal: DirectoryMac, page_size: int
) -> LookupResult:
    """The lookup itself in a tier directory (blocking file system calls: run it on an I/O thread)."""
    return run_lookup_in(req, FileSource(paths, ns, seal), ns, page_size)
