"""Lookups over a Mooncake Store: aliases and headers as objects (`lookup.ExtentSource`).

The walk, its checks and its cost bounds are path_lookup.py's; here an alias is a small object whose
value is the link target a file alias would have ("<extent key hex>.<offset>", parsed as strictly),
and a header is verified by `mooncake_io.open_header`, exactly as a load's. A missing header is a
clean miss (`FileNotFoundError`, as a missing file); an unreachable store refuses the claim.
"""

from __future__ import annotations

from sgl_hicache.tier.format import DirectoryMac
from sgl_hicache.tier.keys import ExtentKey, NamespaceId
from sgl_hicache.tier.mooncake.client import Names, StoreClient
from sgl_hicache.tier.mooncake.objects import Scratch, open_header
from sgl_hicache.tier.path_lookup import Claimed, parse_claim


class StoreSource:
    def __init__(
        self, client: StoreClient, names: Names, ns: NamespaceId, seal: DirectoryMac, scratch: Scratch
    ) -> None:
        self._client, self._names, self._ns, self._seal, self._scratch = client, names, ns, seal, scratch

    def alias(self, path_key: bytes) -> tuple[ExtentKey, int] | None:
        value = self._client.get(self._names.alias(path_key))
        if value is None:
            return None
        try:
            return parse_claim(value.decode("ascii"))
        except UnicodeDecodeError:
            return None

    def header(self, key: ExtentKey) -> Claimed:
        ext = open_header(self._client, self._names, self._ns, key, self._seal, self._scratch)
        return Claimed(ext.header.parent, ext.header.token_count, ext.aliases, ext.tokens)

    def remove_dangling(self, path_key: bytes, key: ExtentKey) -> None:
        """Left to the master's eviction: the store cannot remove an alias only if it still names `key`."""
