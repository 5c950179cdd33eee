"""How this server joins a Mooncake Store as a client (`MooncakeConfig`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sgl_hicache.config.errors import ConfigError, require
from sgl_hicache.config.units import GiB, MiB, parse_size

_MOONCAKE_ENV = {  # field -> Mooncake's own variable (the names sglang's `mooncake` L3 backend reads)
    "master": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
    "ssd_offload_path": "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
}
LOAD_CALLS = ("merged", "by_group")
"""How the tier reads the chunks of a batch of loads that need no layer-group order (a restore that
is not layer-wise): all its groups in one call (up to `LOAD_BATCH_BYTES`), or a call a group as a
layer-wise restore's (tier/mooncake/load.py); kept to compare the two side by side."""
PLACEMENTS = ("any", "local")
"""Where the tier's objects are stored: "any" (the default) leaves the choice to the master's
allocation strategy, as Mooncake's own clients do; "local" asks it for this client's own segment
first (it falls back to another segment when that one is full). A load from the reader's own
segment is a memory copy, from another client's a transfer (tier/mooncake/client.py): "local" makes
a server's loads of what it spilled itself 3x faster at the tier, but on the benchmarks here it did
not shorten a resumed turn, and loads of what another server spilled always cross the network, and
every object a server wrote leaves the store with it (docs/RESULTS.md, docs/OPERATIONS.md)."""
REAL_CLIENT = """With `real_client` (Mooncake's standalone mode: `setup_dummy`) the server joins the store through
a `mooncake_client` process on its own host: that process contributes the DRAM segment (its
`--global_segment_size`), talks to the master and moves every object, and the server's staging is
shared memory it maps, so a load is one local call and a memory copy by that process, whichever
server wrote the object. `master`, `metadata_server`, `global_segment_size` and the transport
settings are then the real client's (its flags), not this server's; `placement` local has no
segment of its own to ask for."""
_MOONCAKE_DEFAULTS: dict[str, Any] = {
    "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "local_hostname": "localhost",
    "global_segment_size": 4 * GiB, "local_buffer_size": 64 * MiB,
}  # fmt: skip


@dataclass(frozen=True)
class MooncakeConfig:
    """How this server joins a Mooncake Store as a client (`--hicache-spill-mooncake-config`, one JSON
    object with these keys; `""` / 0 mean unset, but for `load_calls` and `placement`, ours, which
    have their defaults).
    `with_env` fills what is unset from Mooncake's own variables, then from the defaults above."""

    master: str = ""  # host:port of mooncake_master's RPC
    metadata_server: str = ""  # "http://host:port/metadata" (the master's HTTP one), etcd, or P2PHANDSHAKE
    protocol: str = ""  # tcp, rdma, ...
    device_name: str = ""  # RDMA devices, comma-separated ("" lets Mooncake pick)
    local_hostname: str = ""  # the address other clients reach this one at
    global_segment_size: int = 0  # bytes of DRAM this client contributes to the store
    local_buffer_size: int = 0  # bytes of the client's own transfer buffer
    ssd_offload_path: str = ""  # Mooncake's SSD tier on this host (e.g. an NVMe-oF mount); "" for none
    load_calls: str = (
        "merged"  # a restore's chunks not needed group by group: "merged" (one call), "by_group"
    )
    placement: str = "any"  # where stores go: "any" (the master's choice) or "local" (PLACEMENTS)
    real_client: str = ""  # host:port of a `mooncake_client` on this host to join through (REAL_CLIENT)

    @classmethod
    def from_user(cls, data: object) -> MooncakeConfig:
        """From the flag's JSON object: known keys only, strings, sizes as bytes or with a unit."""
        require(isinstance(data, dict), None, "expected a JSON object of Mooncake settings")
        assert isinstance(data, dict)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        require(not unknown, None, f"unknown key {', '.join(unknown)} (known: {', '.join(names)})")
        given: dict[str, Any] = {k: _mooncake_value(k, v) for k, v in data.items()}
        return cls(**given)

    def with_env(self, environ: Mapping[str, str]) -> MooncakeConfig:
        """Unset fields from Mooncake's variables (`MOONCAKE_MASTER`, ...), then the defaults.
        `MOONCAKE_CLIENT` is the real client's only where `MOONCAKE_STANDALONE_STORAGE` is true
        and no master was given (as sglang's `mooncake` backend reads them); with a real client
        `MOONCAKE_MASTER` is not read (the real client has the master)."""
        real_client = self.real_client
        standalone = _env_bool(environ, "MOONCAKE_STANDALONE_STORAGE")
        if not real_client and not self.master and standalone and environ.get("MOONCAKE_CLIENT"):
            real_client = str(_mooncake_value("real_client", environ["MOONCAKE_CLIENT"]))
        out: dict[str, Any] = {"real_client": real_client}
        for name, var in _MOONCAKE_ENV.items():
            value = getattr(self, name)
            if not value and environ.get(var) and not (real_client and name in _REAL_CLIENT_SETTINGS):
                try:
                    value = _mooncake_value(name, environ[var])
                except ConfigError as e:
                    raise ConfigError(f"{var}: {e}") from None
            out[name] = value or _MOONCAKE_DEFAULTS.get(name, value)
        return dataclasses.replace(self, **out)

    def __post_init__(self) -> None:
        require(self.master == "" or ":" in self.master, None,
                 f"master must be host:port, got {self.master!r}")  # fmt: skip
        require(self.real_client == "" or ":" in self.real_client, None,
                f"real_client must be host:port, got {self.real_client!r}")  # fmt: skip
        require(not (self.real_client and self.master), None,
                "give master or real_client, not both (a real client talks to the master itself)")  # fmt: skip
        require(not self.real_client or self.placement == "any", None,
                "placement local needs a segment of this server's own; with real_client every object "
                "is in the real client's")  # fmt: skip
        require(not self.real_client or not self.ssd_offload_path, None,
                "ssd_offload_path is the real client's with real_client (mooncake_client --enable_offload)")  # fmt: skip
        require(self.load_calls in LOAD_CALLS, None,
                f"load_calls must be {' or '.join(LOAD_CALLS)}, got {self.load_calls!r}")  # fmt: skip
        require(self.placement in PLACEMENTS, None,
                f"placement must be {' or '.join(PLACEMENTS)}, got {self.placement!r}")  # fmt: skip
        for name in ("global_segment_size", "local_buffer_size"):
            size = getattr(self, name)
            require(
                size == 0 or size >= 16 * MiB,
                None,
                f"{name} must be at least 16M (Mooncake's least), got {size}",
            )


_REAL_CLIENT_SETTINGS = ("master", "ssd_offload_path")
"""Settings a real client has in its own flags: not read from Mooncake's variables with one."""


def _env_bool(environ: Mapping[str, str], var: str) -> bool:
    """A boolean variable as sglang's `EnvBool` reads it; anything else is a ConfigError."""
    value = environ.get(var, "").lower()
    if value in ("", "false", "0", "no", "n"):
        return False
    require(value in ("true", "1", "yes", "y"), None, f"{var}: expected a boolean, got {value!r}")
    return True


def _mooncake_value(name: str, value: object) -> str | int:
    if name.endswith("_size"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        require(isinstance(value, str), None, f'{name}: expected a size such as "4G", got {value!r}')
        return parse_size(str(value), 1)  # a bare number is bytes, as Mooncake reads it
    require(isinstance(value, str), None, f"{name}: expected a string, got {value!r}")
    return str(value)
