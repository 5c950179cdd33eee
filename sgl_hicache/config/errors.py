"""The one error a setting raises: `ConfigError`, a one-line message and the field to blame."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting is invalid. The message is one line, fit to show a user as is; `field` names the
    offending dataclass field when one is to blame (flags use it to name the flag)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def require(cond: bool, field: str | None, message: str) -> None:
    if not cond:
        raise ConfigError(message, field)
