"""The layer's dispatch plan under a materialized placement (HECATE Section 4.4 in the layer).

Under FSSDP an expert may be held by several ranks, so a routing choice (token, expert) goes to
one *holder* picked by :func:`moeflow.placement.dispatch.dispatch_plan`. To reuse the layer's
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
:func:`~moeflow.placement.dispatch.token_destinations`, vectorised on the device).
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.comm.exchange import gather_device_counts
from moeflow.devices import to_device_async
from moeflow.dispatch.plan import DispatchPlan, expert_counts, make_plan
from moeflow.placement.dispatch import dispatch_plan
from moeflow.placement.placement import Placement


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


def fssdp_plan(experts: torch.Tensor, num_experts: int, capacity: int | None,
               placement: Placement, rank: int, local_size: int, group, world: int
               ) -> tuple[DispatchPlan, np.ndarray]:
    """Collective over ``group`` (the FSSDP group = the EP group = the world). ``experts: (T, k)``
    routing choices -> the plan over held slots, and ``plan[s, e, d]`` (every rank's)."""
    T, k = experts.shape
    flat = experts.t().reshape(-1)                         # priority order: choice-major
    if capacity is None:
        keep = None
        kept = flat
    else:                                                  # GShard capacity over real experts
        base = make_plan(experts, num_experts, capacity)
        keep = base.slot < base.send_rows
        kept = torch.where(keep, flat, num_experts)        # dropped -> a sentinel expert
    counts = expert_counts(kept, num_experts + 1)[:num_experts]
    every = gather_device_counts(counts, group, world)     # (world, E) on the host
    routes = dispatch_plan(placement, every, local_size)   # (world, E, world), Section 4.4
    slots, slot_of = held_slots(placement)
    n_counts = slot_counts(routes, slot_of, slots)
    dev = flat.device
    # position of each choice among this rank's kept choices of its expert, in priority order
    order = torch.argsort(kept, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    starts = torch.cat([starts, starts.new_zeros(1)])
    ranked = torch.arange(flat.numel(), device=dev) - starts.index_select(
        0, kept.index_select(0, order))
    position = torch.empty_like(ranked).index_copy_(0, order, ranked)
    # destination: the first d with position < cumsum(plan[rank, e, :])[d]
    cum = to_device_async(np.cumsum(routes[rank], axis=1), dev)          # (E, world)
    cum = torch.cat([cum, cum.new_zeros(1, world)])                      # sentinel row
    dest = torch.searchsorted(cum.index_select(0, kept), position.unsqueeze(1),
                              right=True).squeeze(1).clamp(max=world - 1)
    slot_table = to_device_async(np.concatenate([slot_of.T, np.zeros((1, world), np.int64)]),
                                 dev)                                    # (E + 1, world)
    held = slot_table.index_select(0, kept).gather(1, dest.unsqueeze(1)).squeeze(1)
    virtual = dest * slots + held
    if keep is not None:
        virtual = torch.where(keep, virtual, world * slots)   # dropped: sorted last, cut off
    rows = int(n_counts[rank].sum())
    send_order = torch.argsort(virtual, stable=True)[:rows]
    dropped = (~keep).sum() if keep is not None else flat.new_zeros(())
    plan = DispatchPlan(world * slots, T, k, None, send_order, rows, dropped,
                        counts=n_counts, ep_rank=rank)
    return plan, routes


__all__ = ["fssdp_plan", "held_slots", "slot_counts"]
