"""Lookups over a Mooncake Store: aliases and headers as objects (`lookup.ExtentSource`).

The walk, its checks and its cost bounds are path_lookup.py's; here an alias is a small object whose
value is the link target a file alias would have ("<extent key hex>.<offset>", parsed as strictly),
and a header is verified by `objects.verify_header`, exactly as a load's. Both are looked for in the
directory of the request's salt (client.py): a lookup of a salted tenant finds only extents stored
with that salt. A missing header is a clean miss (`FileNotFoundError`, as a missing file); an
unreachable store refuses the claim. Each header verified is reported to `seen` (the tier indexes
it, with its salt, so that a load of it finds its objects). A lookup reads every block position's
alias in one call and the headers they name in another (`aliases`), so that it costs two calls of
the store however long the prompt and its chain.
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_hicache.tier.format import DirectoryMac
from sgl_hicache.tier.keys import ExtentKey, NamespaceId
from sgl_hicache.tier.mooncake.client import Names, StoreClient
from sgl_hicache.tier.mooncake.objects import Gone, Opened, open_header, verify_header
from sgl_hicache.tier.mooncake.scratch import Scratch
from sgl_hicache.tier.path_lookup import Claimed, parse_claim

READ_AHEAD_HEADERS = 64
"""A lookup reads the headers of at most this many extents along with the aliases (the walk verifies
at most `LookupRequest.max_steps`, 32 by default, plus its retries)."""


class StoreSource:
    def __init__(
        self, client: StoreClient, names: Names, ns: NamespaceId, seal: DirectoryMac, scratch: Scratch,
        salt: bytes | None, seen: Callable[[Opened], None],
    ) -> None:  # fmt: skip
        self._client, self._names, self._ns, self._seal, self._scratch = client, names, ns, seal, scratch
        self._salt, self._seen = salt, seen
        self._headers: dict[ExtentKey, bytes | None] = {}  # read ahead with the aliases, used once

    def alias(self, path_key: bytes) -> tuple[ExtentKey, int] | None:
        return _claim(self._client.get(self._names.alias(path_key, self._salt)))

    def aliases(self, path_keys: list[bytes]) -> list[tuple[ExtentKey, int] | None] | None:
        """One batch read of every alias (missing ones are None), then one of the headers they name
        (of the farthest `READ_AHEAD_HEADERS` extents): the walk verifies those from memory."""
        values = self._client.get_many([self._names.alias(k, self._salt) for k in path_keys])
        claims = [_claim(v) for v in values]
        keys = list(dict.fromkeys(c[0] for c in reversed(claims) if c is not None))[:READ_AHEAD_HEADERS]
        raws = self._client.get_many([self._names.header(k, self._salt) for k in keys])
        self._headers = dict(zip(keys, raws, strict=True))
        return claims

    def header(self, key: ExtentKey) -> Claimed:
        if key not in self._headers:
            ext = open_header(self._client, self._names, self._ns, key, self._salt, self._seal, self._scratch)
        else:
            raw = self._headers.pop(key)
            if raw is None:
                raise Gone("mooncake header: not in the store")
            ext = verify_header(raw, self._ns, key, self._salt, self._seal)
        self._seen(ext)
        return Claimed(ext.header.parent, ext.header.token_count, ext.aliases, ext.tokens)

    def remove_dangling(self, path_key: bytes, key: ExtentKey) -> None:
        """Left to the master's eviction: the store cannot remove an alias only if it still names `key`."""


def _claim(value: bytes | None) -> tuple[ExtentKey, int] | None:
    if value is None:
        return None
    try:
        return parse_claim(value.decode("ascii"))
    except UnicodeDecodeError:
        return None
