"""Name -> class registries through which routers, codecs and all-to-all algorithms plug in.

A part registered from user code (``@moeflow.register_codec("mine")``) is accepted by
``MoEConfig`` and built by ``MoELayer`` exactly like a built-in one. :func:`registry` finds a
registry by kind, importing the package of its built-in parts by name, so that
:mod:`moeflow.config` validates names without importing those packages (which import
:mod:`moeflow.errors`, never ``moeflow.config``).
"""

from __future__ import annotations

import difflib
import importlib
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")

# The package whose import registers each kind's built-in parts.
PACKAGES = {"router": "moeflow.routing", "codec": "moeflow.comm.codecs",
            "alltoall": "moeflow.comm.alltoall", "scheduler": "moeflow.schedule",
            "activation": "moeflow.experts.activations", "experts": "moeflow.experts.ffn",
            "strategy": "moeflow.strategies"}
REGISTRIES: dict[str, "Registry"] = {}


def registry(kind: str) -> "Registry":
    """The registry of ``kind`` (a key of :data:`PACKAGES`), with its built-in parts."""
    if kind not in PACKAGES:
        raise KeyError(f"unknown registry kind {kind!r}; choose one of {', '.join(PACKAGES)}")
    importlib.import_module(PACKAGES[kind])
    return REGISTRIES[kind]


def did_you_mean(name, choices: Iterable) -> str:
    """``"; did you mean 'x'?"`` for the choices close to ``name`` (difflib), else ``""``.

    The one place typo suggestions are made: config errors, registries and CLI options use it.
    """
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def completed_options(field: str, kind: str, name: str, given: dict | None,
                      defaults: dict) -> dict:
    """``given`` (``MoEConfig.<field>`` of the ``kind`` called ``name``) completed with the
    part's ``defaults``; a ConfigError names an option the part does not take, with the
    options it does take and a typo suggestion. Values are the part's to validate."""
    from moeflow.errors import ConfigError

    given = dict(given or {})
    for key in given:
        if key not in defaults:
            known = ", ".join(sorted(defaults)) or "none"
            raise ConfigError(
                f"MoEConfig.{field} has {key!r}, which {kind} {name!r} does not take (its "
                f"options: {known}){did_you_mean(key, defaults)}")
    return {**defaults, **given}


class Registry(dict):
    def __init__(self, kind: str, base: type):
        super().__init__()
        self.kind = kind
        self.base = base
        REGISTRIES[kind] = self

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"register_{self.kind}({name!r}): {cls!r} must subclass "
                                f"{self.base.__module__}.{self.base.__name__}")
            if name in self and self[name] is not cls:
                raise ValueError(f"register_{self.kind}({name!r}): the name is already taken by "
                                 f"{self[name].__module__}.{self[name].__name__}; pick another")
            cls.name = name
            self[name] = cls
            return cls
        return deco

    def build(self, name: str, **kwargs):
        if name not in self:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self))}"
                           f"{did_you_mean(name, self)}")
        return self[name](**kwargs)
