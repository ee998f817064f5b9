"""FSSDP's settings for one MoE layer (``MoEConfig(placement="fssdp", fssdp={...})``).

HECATE (``hecate.txt``) Section 3.2 and 4.2: how each iteration's materialized placement ``P'``
is chosen and how the materialized experts live in memory. A plain dataclass (no torch), so
:mod:`moeflow.config` validates it at construction; a dict given in the config (or on the CLI as
JSON, ``--set fssdp='{"rematerialize": true}'``) becomes one of these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeflow.errors import ConfigError

PLACEMENTS = ("ep", "fssdp")
# How P' is chosen before each iteration: "static" keeps P' = P (FSSDP storage, EP's data
# flow); "manual" uses the holders set on the layer (FSSDPExperts.set_holders: tests, benchmarks,
# a user's own planner).
MATERIALIZATIONS = ("static", "manual")


@dataclass
class FSSDPOptions:
    """``materialize``: how ``P'`` is chosen (:data:`MATERIALIZATIONS`).
    ``rematerialize``: HECATE-RM (Section 3.2, "SparseAllGather is launched twice ... in each
    iteration"): free the materialized experts after the forward and gather them again for
    the backward. ``early_gather``: in the GPT block, launch the layer's spAG on its
    communication lane before the block's attention so that it overlaps it (Fig. 1c)."""

    materialize: str = "static"
    rematerialize: bool = False
    early_gather: bool = True

    def __post_init__(self) -> None:
        o = "MoEConfig.fssdp"
        if self.materialize not in MATERIALIZATIONS:
            raise ConfigError(f"{o}.materialize={self.materialize!r} is invalid: choose one of "
                              f"{', '.join(MATERIALIZATIONS)} ('static': P' = P; 'manual': the "
                              "holders set with FSSDPExperts.set_holders)")
        for name in ("rematerialize", "early_gather"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ConfigError(f"{o}.{name}={v!r} is invalid: must be true or false")

    @classmethod
    def coerce(cls, value) -> "FSSDPOptions":
        """``None`` (defaults), a dict of fields, or an instance -> an instance."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"MoEConfig.fssdp={value!r} is invalid: give a dict of FSSDP "
                              f"options ({', '.join(f.name for f in dataclasses.fields(cls))}) "
                              "or None for the defaults")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"MoEConfig.fssdp has unknown options {unknown}: the options are "
                              f"{', '.join(sorted(known))}")
        return cls(**value)


__all__ = ["FSSDPOptions", "MATERIALIZATIONS", "PLACEMENTS"]
