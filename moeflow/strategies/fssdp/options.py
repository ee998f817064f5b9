"""FSSDP's settings for one MoE layer (``MoEConfig(placement="fssdp", fssdp={...})``).

HECATE (``hecate.txt``) Section 3.2 and 4.2: how each iteration's materialized placement ``P'``
is chosen and how the materialized experts live in memory. A plain dataclass (no torch), so
:mod:`moeflow.config` validates it at construction; a dict given in the config (or on the CLI as
JSON, ``--set moe.fssdp='{"rematerialize": true}'``) becomes one of these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeflow.errors import ConfigError

# How P' is chosen before each iteration: "static" keeps P' = P (FSSDP storage, EP's data
# flow); "sparse" is HECATE's Algorithm 1 (Section 4.2) on the sliding-window load estimate;
# "manual" uses the holders set on the layer (FSSDPExperts.set_holders: tests, benchmarks,
# a user's own planner).
MATERIALIZATIONS = ("static", "sparse", "manual")
# How spAG / spRS move the experts (Section 3.1; Section 5 "Implementation"): "p2p" batched
# point-to-point from the owner to each holder; "broadcast" one broadcast (spRS: reduce) per
# replicated expert in a cached process group of its holders; "auto" times both once on the
# first iteration that replicates an expert and keeps the faster (the same choice on every rank)
TRANSPORTS = ("p2p", "broadcast", "auto")


@dataclass
class FSSDPOptions:
    """``materialize``: how ``P'`` is chosen (:data:`MATERIALIZATIONS`).
    ``rematerialize``: HECATE-RM (Section 3.2, "SparseAllGather is launched twice ... in each
    iteration"): free the materialized experts after the forward and gather them again for
    the backward. ``early_gather``: in the GPT block, launch the layer's spAG on its
    communication lane before the block's attention so that it overlaps it (Fig. 1c).
    ``transport``: how spAG / spRS move the experts (:data:`TRANSPORTS`; the choice ``auto``
    made is in ``layer.stats["fssdp_transport_broadcast"]``, with both measured times; ``auto``
    times broadcasts only for a manual P' of few holder sets, else keeps p2p:
    :func:`moeflow.strategies.fssdp.transport.broadcast_candidate`).
    ``overlap_backward``: run the backward's spRS on the layer's communication lane, so that it
    overlaps the block's attention backward (Section 3.2); the backward waits for it before
    the next FSSDP layer's backward and at its end (timing changes only).
    ``overlap_regather``: with ``rematerialize``, issue HECATE-RM's second spAG (the re-gather
    of the freed experts) on the communication lane when the backward of what follows the
    layer starts, and wait for it at the layer's backward (Section 3.2: the spAG overlaps the
    attention backward). The GPT triggers it at the next block's attention backward (the last
    MoE layer: at the start of the backward); elsewhere :meth:`moeflow.layer.MoELayer.
    regather_on_grad` names the trigger tensor, and without one the re-gather runs in place.
    Refused under ``--recompute full`` (the recomputation gathers the experts itself).
    ``overlap_backward`` and ``overlap_regather`` are refused under FSDP2 (``--dense-shard
    fsdp``: its collectives would run beside the lane's, :func:`moeflow.parallel.fsdp.
    check_lane_overlap`).

    Algorithm 1 (``materialize="sparse"``, :mod:`moeflow.strategies.fssdp.materialize`):
    ``overlap_degree`` is ``t`` (None: ``T_non-MoE * bw / expert_size`` from the measured time
    between the block's start and the layer, and ``bw`` = ``bandwidth_Bps``, or the inter-node
    point-to-point fit of the ``links`` JSON of ``moeflow bench links``); ``memory_capacity``
    is ``m``, the replicas a rank may hold, given directly; ``memory_budget_bytes`` (bytes)
    or ``memory_budget_fraction`` (of the device's free memory at start, measured once per
    process and device) derive ``m`` instead, as the replicas whose worst-case peak of held
    rows, gradient copies and transport buffers adds at most the budget per layer, the minimum
    over the ranks (:mod:`moeflow.strategies.fssdp.memory`); with none of the three, ``m`` is
    the number of experts
    a rank owns. ``window`` is ``w``
    (HECATE: 5); ``calibrate`` re-plans after the gate with the real loads and keeps the new
    plan only if its predicted latency, extra spAG included, is lower.

    Algorithm 2 (Section 4.3, :mod:`moeflow.strategies.fssdp.reshard`): every ``reshard_every``
    optimizer steps (0: never) ``moeflow train`` re-shards all FSSDP layers together; the
    parameters and the optimizer state move to the new owners.

    ``replace_every``: the SmartMoE-style peer (HECATE Section 2.3, :mod:`moeflow.strategies.fssdp.
    replace`): every N optimizer steps (0: never) ``moeflow train`` re-assigns each layer's
    whole experts to ranks by the load window (no replication, each rank keeps its number of
    experts) and moves parameters and optimizer state; ``P' = P`` in between (plain EP data
    flow), so it needs ``materialize="static"`` and no ``reshard_every``."""

    materialize: str = "static"
    rematerialize: bool = False
    early_gather: bool = True
    overlap_degree: int | None = None
    memory_capacity: int | None = None
    memory_budget_bytes: int | None = None
    memory_budget_fraction: float | None = None
    bandwidth_Bps: float | None = None
    links: str | None = None
    window: int = 5
    calibrate: bool = False
    reshard_every: int = 0
    replace_every: int = 0
    transport: str = "p2p"
    overlap_backward: bool = False
    overlap_regather: bool = False

    def __post_init__(self) -> None:
        o = "MoEConfig.fssdp"
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"{o}.transport={self.transport!r} is invalid: choose one of "
                              f"{', '.join(TRANSPORTS)} ('p2p': point-to-point from the owner; "
                              "'broadcast': a broadcast per expert in its holders' group; "
                              "'auto': time both once and keep the faster)")
        if self.materialize not in MATERIALIZATIONS:
            raise ConfigError(f"{o}.materialize={self.materialize!r} is invalid: choose one of "
                              f"{', '.join(MATERIALIZATIONS)} ('static': P' = P; 'manual': the "
                              "holders set with FSSDPExperts.set_holders)")
        for name in ("rematerialize", "early_gather", "calibrate", "overlap_backward",
                     "overlap_regather"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ConfigError(f"{o}.{name}={v!r} is invalid: must be true or false")
        for name in ("overlap_degree", "memory_capacity"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ConfigError(f"{o}.{name}={v!r} is invalid: give an integer >= 0 (a "
                                  "number of experts) or None to derive it")
        v = self.memory_budget_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ConfigError(f"{o}.memory_budget_bytes={v!r} is invalid: give the bytes each "
                              "rank may add per layer for materialized experts (held rows, "
                              "gradient copies, transport buffers; an integer >= 0), or None")
        v = self.memory_budget_fraction
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0 < v <= 1):
            raise ConfigError(f"{o}.memory_budget_fraction={v!r} is invalid: give a fraction "
                              "of the measured free memory in (0, 1], or None")
        given = [n for n in ("memory_capacity", "memory_budget_bytes", "memory_budget_fraction")
                 if getattr(self, n) is not None]
        if len(given) > 1:
            raise ConfigError(f"{o}: {' and '.join(given)} are both set: m is either a count "
                              "(memory_capacity) or derived from one budget (memory_budget_bytes "
                              "or memory_budget_fraction); keep one")
        if given and given[0] != "memory_capacity" and self.materialize != "sparse":
            raise ConfigError(f"{o}.{given[0]} is invalid with materialize="
                              f"{self.materialize!r}: the budget sets Algorithm 1's m; use "
                              "materialize='sparse'")
        if isinstance(self.reshard_every, bool) or not isinstance(self.reshard_every, int) \
                or self.reshard_every < 0:
            raise ConfigError(f"{o}.reshard_every={self.reshard_every!r} is invalid: give "
                              "optimizer steps between re-shards (an integer >= 1), or 0")
        if isinstance(self.replace_every, bool) or not isinstance(self.replace_every, int) \
                or self.replace_every < 0:
            raise ConfigError(f"{o}.replace_every={self.replace_every!r} is invalid: give "
                              "optimizer steps between expert re-placements (an integer >= "
                              "1), or 0")
        if self.replace_every and self.materialize != "static":
            raise ConfigError(f"{o}.replace_every={self.replace_every} is invalid with "
                              f"materialize={self.materialize!r}: the SmartMoE-style "
                              "re-placement keeps P' = P (no replicas); use "
                              "materialize='static', or drop replace_every")
        if self.replace_every and self.reshard_every:
            raise ConfigError(f"{o}: replace_every={self.replace_every} and reshard_every="
                              f"{self.reshard_every} both move the owners; keep one "
                              "(replace_every: SmartMoE-style; reshard_every: Algorithm 2)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"{o}.window={self.window!r} is invalid: give an integer >= 1 "
                              "(HECATE uses 5)")
        if self.bandwidth_Bps is not None and (isinstance(self.bandwidth_Bps, bool) or not
                                               isinstance(self.bandwidth_Bps, (int, float))
                                               or self.bandwidth_Bps <= 0):
            raise ConfigError(f"{o}.bandwidth_Bps={self.bandwidth_Bps!r} is invalid: give "
                              "bytes per second > 0, or None")
        if self.materialize == "sparse" and self.overlap_degree is None \
                and self.bandwidth_Bps is None and self.links is None:
            raise ConfigError(f"{o}: materialize='sparse' derives the overlap degree t from a "
                              "bandwidth: give bandwidth_Bps, links (a `moeflow bench links` "
                              "JSON) or overlap_degree")
        if self.materialize == "sparse" and self.overlap_degree is None \
                and not self.early_gather:
            raise ConfigError(f"{o}: materialize='sparse' derives the overlap degree t from "
                              "T_non-MoE, measured from the block's early spAG "
                              "(early_gather=True) to the MoE layer; with "
                              "early_gather=False nothing measures it (t would be 0: static "
                              "placement): set early_gather=True or give overlap_degree")
        if self.overlap_regather and not self.rematerialize:
            raise ConfigError(f"{o}.overlap_regather=True is invalid with rematerialize=False: "
                              "only HECATE-RM frees the experts after the forward and gathers "
                              "them again in backward; set rematerialize=True, or drop "
                              "overlap_regather")
        if self.calibrate and self.materialize != "sparse":
            raise ConfigError(f"{o}.calibrate=True is invalid with materialize="
                              f"{self.materialize!r}: calibration re-runs Algorithm 1; use "
                              "materialize='sparse'")

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


__all__ = ["FSSDPOptions", "MATERIALIZATIONS", "TRANSPORTS"]
