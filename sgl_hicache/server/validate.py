"""Checks run by the launcher before sglang starts: fail fast with one line, write nothing."""

from __future__ import annotations

import os
from pathlib import Path

from sgl_hicache.config import ConfigError, SpillConfig, TierConfig
from sgl_hicache.tier.trust import UntrustedDirectory, check_trusted
from sgl_hicache.tier.volume import too_small


def check_tier_directory(directory: Path) -> None:
    """The tier directory must be a writable directory, or creatable under a writable one, and, if
    it exists, trusted as the tier would at open (ours, no symlink, not group/other-writable, its
    secret private: `tier.trust`).

    Raises ConfigError naming the flag. Creates nothing: the tier creates the directory when it opens.
    """
    path = Path(directory)
    if not path.is_absolute():
        raise ConfigError(f"--hicache-spill-dir: {path} is not an absolute path")
    existing = _existing(path)
    if existing != path and not existing.is_dir():
        raise ConfigError(f"--hicache-spill-dir: {existing} is not a directory, so {path} cannot be created")
    if not existing.is_dir():
        raise ConfigError(f"--hicache-spill-dir: {path} exists and is not a directory")
    try:
        check_trusted(path)
    except UntrustedDirectory as e:
        raise ConfigError(f"--hicache-spill-dir: {e}") from None
    except OSError as e:
        raise ConfigError(f"--hicache-spill-dir: cannot check {path}: {e.strerror}") from None
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise ConfigError(f"--hicache-spill-dir: {existing} is on a read-only filesystem")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "" if existing == path else f" (to create {path})"
        raise ConfigError(f"--hicache-spill-dir: no write permission on {existing}{what}")


def check_volume(tier: TierConfig) -> None:
    """The volume must be larger than the free-space watermark plus a useful capacity, else every
    store would be refused (`tier.volume`). Raises ConfigError naming --hicache-spill-min-free."""
    reason = too_small(tier, _existing(Path(tier.directory)))
    if reason is not None:
        raise ConfigError(reason, "min_free_bytes")


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where the tier directory would be created)."""
    while not path.exists():
        path = path.parent
    return path


def check_config(config: SpillConfig) -> None:
    """Everything about `config` that depends on this machine (pure checks ran at construction)."""
    if config.enabled:
        check_tier_directory(config.tier.directory)
        check_volume(config.tier)
