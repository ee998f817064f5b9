"""The checks every config class shares: a ConfigError naming the class, the field, the value
and the fix (``config_error``), raised when a condition fails (``_require``)."""

from __future__ import annotations

from moeflow.errors import ConfigError


def config_error(owner: str, name: str, value, fix: str) -> ConfigError:
    return ConfigError(f"{owner}.{name}={value!r} is invalid: {fix}")


def _require(cond: bool, owner: str, name: str, value, fix: str) -> None:
    if not cond:
        raise config_error(owner, name, value, fix)


def _positive_int(owner: str, name: str, value) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             owner, name, value, "must be a positive integer")
