"""HECATE's FSSDP in the simulator (``MoEConfig(placement="fssdp")``, Sections 3-4).

What changes against expert parallelism, each from the library's placement code:

* **the placement** ``P'`` (Section 3.2): ``static`` (``P' = P``, the even owners of
  :meth:`moeflow.strategies.fssdp.placement.Placement.even`), ``sparse`` (Algorithm 1,
  :func:`moeflow.strategies.fssdp.materialize.sparse_materialize`, with the overlap degree ``t`` and
  memory capacity ``m`` given, on the sample's per-expert loads: the steady state in which the
  window of the last ``w`` iterations holds this routing), or ``manual`` holders;
* **the token dispatch** (Section 4.4): capacity over the real experts first (GShard, as the
  layer's :class:`~moeflow.strategies.fssdp.token_plan.KeptChoices`), then every kept choice to one
  holder by :func:`moeflow.strategies.fssdp.topology_dispatch.dispatch_plan`; the count matrix over held slots
  (:func:`~moeflow.strategies.fssdp.token_plan.held_slots`, :func:`~moeflow.strategies.fssdp.token_plan.
  slot_counts`) is what the all-to-alls, chunks and experts of :mod:`.layer` then run on,
  exactly as the layer reuses the EP exchange;
* **spAG** before the layer (Section 3.1: each owner sends its expert to every new holder;
  bytes :func:`moeflow.comm.sparse.spag_send_bytes`) and **spRS** after the backward's expert
  gradients (:func:`~moeflow.comm.sparse.sprs_send_bytes`); with ``rematerialize``
  (HECATE-RM) a second spAG before the backward's experts. Each is timed as the point-to-point
  fit (the ``p2p`` transport, the library's default) at the largest volume a rank sends or
  receives, over the inter-node link when any of its transfers crosses nodes; all ranks wait for
  it together (the batched point-to-point is one step of every rank).

Not modelled: the early spAG's overlap with the block's attention (a layer alone has none),
``calibrate``, the broadcast transport, re-sharding (Algorithm 2) and re-placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeflow.comm.sparse import spag_send_bytes, sprs_send_bytes
from moeflow.dispatch.capacity import capacity
from moeflow.dispatch.plan import expert_counts, make_plan
from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.topology_dispatch import dispatch_plan
from moeflow.strategies.fssdp.materialize import sparse_materialize
from moeflow.strategies.fssdp.placement import Placement
from moeflow.strategies.fssdp.token_plan import held_slots, slot_counts

MATERIALIZE = ("static", "sparse", "manual")


@dataclass(frozen=True)
class FSSDPSpec:
    """``MoEConfig.fssdp``'s fields that shape the step (``t``, ``m`` as counts)."""

    materialize: str = "static"
    overlap_degree: int = 0                 # Algorithm 1's t
    memory_capacity: int | None = None      # m; None: the experts a rank owns (the layer's)
    rematerialize: bool = False
    holders: tuple | None = None            # materialize="manual": P', one rank set per expert

    def __post_init__(self) -> None:
        if self.materialize not in MATERIALIZE:
            raise ConfigError(f"FSSDPSpec.materialize={self.materialize!r} is invalid; choose "
                              f"one of {', '.join(MATERIALIZE)}")
        if self.materialize == "manual" and self.holders is None:
            raise ConfigError("FSSDPSpec.materialize='manual' needs holders: give one set of "
                              "ranks per expert")
        if not isinstance(self.overlap_degree, int) or self.overlap_degree < 0:
            raise ConfigError(f"FSSDPSpec.overlap_degree={self.overlap_degree!r} is invalid: "
                              "an integer >= 0 (Algorithm 1's t)")


def expert_numel(d_model: int, d_expert: int, activation: str, bias: bool = False) -> int:
    """Elements of one expert's row in the slot tensor (``w1, [w3], w2, [b1, b3, b2]``)."""
    mats = 3 if activation == "swiglu" else 2
    return mats * d_model * d_expert + (((mats - 1) * d_expert + d_model) if bias else 0)


def kept_counts(spec, routing: list | None) -> np.ndarray:
    """``(world, E)`` kept choices per rank and expert: GShard capacity over the real experts,
    as :class:`~moeflow.strategies.fssdp.token_plan.KeptChoices` (uniform expectation without ids)."""
    E, k, T, W = spec.num_experts, spec.top_k, spec.tokens, spec.world
    cap = None if spec.capacity_factor is None else capacity(T, k, E, spec.capacity_factor)
    if routing is None:
        even = np.full(E, (T * k) // E, dtype=np.int64)
        even[: (T * k) % E] += 1
        return np.tile(even if cap is None else np.minimum(even, cap), (W, 1))
    rows = []
    for ids in routing:
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
        flat = ids.t().reshape(-1)
        if cap is not None:
            plan = make_plan(ids, E, cap)
            flat = torch.where(plan.slot < plan.send_rows, flat, E)
        rows.append(expert_counts(flat, E + 1)[:E].numpy())
    return np.stack(rows).astype(np.int64)


def placement(spec, fs: FSSDPSpec, loads: np.ndarray) -> Placement:
    """``P'`` of this call (owners: the even sharding the layer starts from)."""
    owners = Placement.even(spec.num_experts, spec.world)
    if fs.materialize == "static":
        return owners
    if fs.materialize == "manual":
        return owners.materialize(fs.holders)
    m = spec.num_experts // spec.world if fs.memory_capacity is None else fs.memory_capacity
    return sparse_materialize(owners, loads, fs.overlap_degree, m, spec.ranks_per_node)


def plan(spec, fs: FSSDPSpec, routing: list | None) -> dict:
    """Everything the step needs: ``P'``, the count matrix over held slots, the slots per rank
    and the spAG / spRS bytes each rank sends."""
    every = kept_counts(spec, routing)
    p1 = placement(spec, fs, every.sum(0).astype(np.float64))
    routes = dispatch_plan(p1, every, spec.ranks_per_node)
    slots, slot_of = held_slots(p1)
    # an expert's row at the widths it is built with (BigMac: rM -> F/r -> rM, Eq. 4)
    expert_bytes = expert_numel(spec.width, spec.hidden, spec.activation) * spec.elem_bytes
    W = spec.world
    p0c, p1c = p1.owner_chunks(), p1.holder_chunks()
    spag = spag_send_bytes(p0c, p1c, expert_bytes, W)
    sprs = sprs_send_bytes(p1c, p0c, expert_bytes, W)
    recv = [len(p1.replicas(d)) * expert_bytes for d in range(W)]
    return {"placement": p1, "kept": every, "routes": routes, "slots": slots,
            "counts": slot_counts(routes, slot_of, slots), "expert_bytes": expert_bytes,
            "spag_send_bytes": spag, "sprs_send_bytes": sprs, "replica_bytes": recv}


def sparse_seconds(spec, costs, p1: Placement, send: list[int], recv: list[int],
                   owner_sends: bool) -> float:
    """One spAG (``owner_sends``) or spRS: the slowest rank's point-to-point volume."""
    L = spec.ranks_per_node
    worst = 0.0
    for d in range(spec.world):
        if not send[d] and not recv[d]:
            continue
        cross = False        # any of d's transfers between nodes: the inter-node link's fit
        for e, h in enumerate(p1.holders):
            o = p1.owners[e]
            if len(h) > 1 and ((o == d and any(r // L != d // L for r in h))
                               or (d in h and o != d and o // L != d // L)):
                cross = True
        cls = "inter" if cross else "intra"
        worst = max(worst, costs.link(cls, "p2p").predict(float(max(send[d], recv[d]))))
    return worst


__all__ = ["FSSDPSpec", "MATERIALIZE", "expert_numel", "kept_counts", "placement", "plan",
           "sparse_seconds"]
