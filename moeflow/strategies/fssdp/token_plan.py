"""The layer's dispatch plan under a materialized placement (HECATE Section 4.4 in the layer).

Under FSSDP an expert may be held by several ranks, so a routing choice (token, expert) goes to
one *holder* picked by :func:`moeflow.strategies.fssdp.topology_dispatch.dispatch_plan`. To reuse the layer's
whole exchange path (pipelined chunks, codecs, every all-to-all algorithm, the schedulers)
unchanged, the plan is written over **held slots**: rank ``d`` has ``slots`` slots, slot ``j``
holding the ``j``-th expert of ``P'.held(d)`` (ascending) and the rest empty. Held slot
``v = d * slots + j`` plays the role of a global expert of static expert parallelism: the send
buffer is ordered by ``v``, so its blocks go to consecutive ranks, and the count matrix
``N[s][v]`` is what the chunks and the all-to-all read (:mod:`moeflow.schedule.chunks`).

Capacity (GShard) is applied first over the *real* experts, exactly as under EP, so the kept
choices and the function are the same; only kept choices get a send row. The per-(source,
expert) counts of kept choices are exchanged (one small all-gather; under FSSDP the dispatcher
needs every rank's counts, so capacity mode also reads them on the host), then every rank builds
the same ``plan[s, e, d]`` on the host.

Within a source rank the choices of one expert, in priority order (choice-major), fill its
destinations in ascending rank order, the blocks ``plan[s, e, :]`` says (the same rule as
``tests/reference/destinations.py``, vectorised on the device).
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.comm.exchange import gather_device_counts
from moeflow.devices import to_device_async
from moeflow.dispatch.plan import DispatchPlan, expert_counts, make_plan
from moeflow.strategies.fssdp.topology_dispatch import dispatch_plan
from moeflow.strategies.fssdp.placement import Placement


def held_slots(placement: Placement) -> tuple[int, np.ndarray]:
    """``(slots, slot_of)``: the held-slot count per rank (the largest ``|P'.held(d)|``, at
    least 1) and ``slot_of[d, e]``, the slot of expert ``e`` on rank ``d`` (-1 if not held)."""
    world, E = placement.world_size, placement.num_experts
    slot_of = np.full((world, E), -1, dtype=np.int64)
    slots = 1
    for d in range(world):
        held = placement.held(d)
        slots = max(slots, len(held))
        slot_of[d, held] = np.arange(len(held))
    return slots, slot_of


def slot_counts(plan: np.ndarray, slot_of: np.ndarray, slots: int) -> np.ndarray:
    """``plan[s, e, d]`` -> ``N[s, d * slots + j]``: rows rank ``s`` sends to held slot ``j`` of
    rank ``d``."""
    world, E, _ = plan.shape
    out = np.zeros((world, world * slots), dtype=np.int64)
    for d in range(world):
        for e in np.flatnonzero(slot_of[d] >= 0):
            out[:, d * slots + slot_of[d, e]] = plan[:, e, d]
    return out


class KeptChoices:
    """This rank's routing choices after capacity, with every rank's per-expert counts."""

    def __init__(self, experts: torch.Tensor, num_experts: int, capacity: int | None,
                 group, world: int, extras: list[int] = ()):
        """Collective over ``group`` (the FSSDP group = the world). ``extras``: host integers
        every rank adds to the exchange (HECATE's measured times; ``self.extras`` holds every
        rank's, ``(world, len(extras))``)."""
        T, k = experts.shape
        self.T, self.k, self.num_experts = T, k, num_experts
        self.flat = experts.t().reshape(-1)                 # priority order: choice-major
        if capacity is None:
            self.keep, self.kept = None, self.flat
        else:                                               # GShard capacity, real experts
            base = make_plan(experts, num_experts, capacity)
            self.keep = base.slot < base.send_rows
            self.kept = torch.where(self.keep, self.flat, num_experts)   # dropped: sentinel
        self.counts = expert_counts(self.kept, num_experts + 1)[:num_experts]
        # pinned, non-blocking: a pageable host-to-device copy would synchronise the stream
        mine = torch.cat([self.counts, to_device_async(list(extras), self.counts.device,
                                                       dtype=self.counts.dtype)])
        every = gather_device_counts(mine, group, world)
        self.every = every[:, :num_experts]                 # (world, E) on the host
        self.extras = every[:, num_experts:]


def fssdp_plan(kept: KeptChoices, placement: Placement, rank: int, local_size: int
               ) -> tuple[DispatchPlan, np.ndarray]:
    """The plan over held slots for ``placement`` (``P'``), and ``plan[s, e, d]``."""
    world = placement.world_size
    routes = dispatch_plan(placement, kept.every, local_size)   # (world, E, world), Sec. 4.4
    slots, slot_of = held_slots(placement)
    n_counts = slot_counts(routes, slot_of, slots)
    flat, keep, counts = kept.flat, kept.keep, kept.counts
    dev = flat.device
    # position of each choice among this rank's kept choices of its expert, in priority order
    order = torch.argsort(kept.kept, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    starts = torch.cat([starts, starts.new_zeros(1)])
    ranked = torch.arange(flat.numel(), device=dev) - starts.index_select(
        0, kept.kept.index_select(0, order))
    position = torch.empty_like(ranked).index_copy_(0, order, ranked)
    # destination: the first d with position < cumsum(plan[rank, e, :])[d]
    cum = to_device_async(np.cumsum(routes[rank], axis=1), dev)          # (E, world)
    cum = torch.cat([cum, cum.new_zeros(1, world)])                      # sentinel row
    dest = torch.searchsorted(cum.index_select(0, kept.kept), position.unsqueeze(1),
                              right=True).squeeze(1).clamp(max=world - 1)
    slot_table = to_device_async(np.concatenate([slot_of.T, np.zeros((1, world), np.int64)]),
                                 dev)                                    # (E + 1, world)
    held = slot_table.index_select(0, kept.kept).gather(1, dest.unsqueeze(1)).squeeze(1)
    virtual = dest * slots + held
    if keep is not None:
        virtual = torch.where(keep, virtual, world * slots)   # dropped: sorted last, cut off
    rows = int(n_counts[rank].sum())
    send_order = torch.argsort(virtual, stable=True)[:rows]
    dropped = (~keep).sum() if keep is not None else flat.new_zeros(())
    plan = DispatchPlan(world * slots, kept.T, kept.k, None, send_order, rows, dropped,
                        counts=n_counts, ep_rank=rank)
    return plan, routes


__all__ = ["KeptChoices", "fssdp_plan", "held_slots", "slot_counts"]
