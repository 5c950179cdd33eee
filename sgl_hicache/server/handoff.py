"""How the config reaches sglang's spawned scheduler processes: one environment variable.

sglang spawns its scheduler processes (multiprocessing "spawn"), which inherit the environment
but no Python state. The launcher serializes the validated `SpillConfig` into `SGL_HICACHE_CONFIG`;
the cache factory in the scheduler reads it back. Without the variable (a plain
`python -m sglang.launch_server --radix-cache-backend hicache_spill`), the config is built from the
`SGL_HICACHE_*` overrides and defaults, with spill enabled since the backend was asked for.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, MutableMapping

from sgl_hicache.config import SpillConfig

ENV_CONFIG = "SGL_HICACHE_CONFIG"


def export_config(config: SpillConfig, environ: MutableMapping[str, str] | None = None) -> None:
    (os.environ if environ is None else environ)[ENV_CONFIG] = config.to_json()


def import_config(environ: Mapping[str, str] | None = None) -> SpillConfig:
    environ = os.environ if environ is None else environ
    if ENV_CONFIG in environ:
        return SpillConfig.from_json(environ[ENV_CONFIG])
    from sgl_hicache.server.flags import config_from

    return dataclasses.replace(config_from(None, environ), enabled=True)
