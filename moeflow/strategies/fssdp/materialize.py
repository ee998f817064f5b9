"""Sparse materialization, HECATE Algorithm 1 (Section 4.2): choose ``P'`` from estimated loads.

Inputs, as the paper defines them:

* ``P``: the owner shard map (:class:`Placement`).
* ``F``: the expert load distribution, estimated as the mean of the last ``w`` iterations' loads
  (:class:`LoadWindow`, HECATE uses ``w = 5``).
* ``t``: the overlap degree, "the maximum number of experts that can be materialized on other
  devices with the communication overhead completely hidden", ``t = T_non-MoE * bw /
  expert_size`` (:func:`overlap_degree`); on a hierarchical cluster ``bw`` is the inter-node
  bandwidth (:func:`link_bandwidth` reads it from ``moeflow bench links`` fits).
* ``m``: the memory capacity, the number of experts a device can additionally materialize.

Algorithm 1, line by line (:func:`sparse_materialize`):

1. ``t <- min(t, |E|)``, ``m <- min(m, t)``; 2. ``P' <- P``;
3-5. if ``t <= m``: the top-``t`` experts by load are materialized on every device;
6-11. else: ``totSlots = |D| * m``; for each top-``t`` expert by descending load,
   ``n <- assignSlotsByLoad`` (its share of ``totSlots`` proportional to its load among the
   top ``t``, largest remainders, at most ``|D| - 1`` replicas) and the ``n`` replicas are
   distributed "across nodes and devices, prioritizing nodes with more available slots" and
   (the text of Section 4.2) "nodes that do not already have the expert parameters
   materialized": one replica at a time, to the node without the expert first, then the node
   with the most free slots, then the device with the most free slots (ties: lower id).
   A slot an expert cannot use (every device with a free slot already holds it) goes to the
   next candidate in load order, and a final sweep over the top ``t`` places one replica at a
   time until no free slot can host any of them: the budget ``|D| m`` is never left unspent
   where a top-``t`` expert could use it.

Every input is the same on every rank (the loads come from the count exchange, ``t`` from the
ranks' mean measurement carried in it), so every rank computes the same ``P'``.

*Calibration* (Section 4.2, optional): :func:`calibrate` re-runs Algorithm 1 from ``P'`` with
the current iteration's loads and the remaining capacity, and accepts the result only if the
predicted latency (expert phase and the dispatch / combine all-to-alls), extra spAG included, is
lower (:func:`predicted_latency`).
"""

from __future__ import annotations

import collections
import json

import numpy as np

from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.topology_dispatch import dispatch_plan
from moeflow.strategies.fssdp.placement import Placement

WINDOW = 5     # Section 4.2: "HECATE uses w = 5"


class LoadWindow:
    """Sliding-window load estimate: the mean of the last ``w`` iterations' per-expert loads."""

    def __init__(self, num_experts: int, w: int = WINDOW):
        if w < 1:
            raise ConfigError(f"load window w={w} is invalid: it must be >= 1 (HECATE: 5)")
        self.num_experts = num_experts
        self._loads: collections.deque = collections.deque(maxlen=w)

    def add(self, loads) -> None:
        loads = np.asarray(loads, dtype=np.float64)
        if loads.shape != (self.num_experts,):
            raise ValueError(f"LoadWindow.add: loads of shape {loads.shape}, expected "
                             f"({self.num_experts},)")
        self._loads.append(loads)

    def __len__(self) -> int:
        return len(self._loads)

    def estimate(self) -> np.ndarray | None:
        """``F``: the window's mean load per expert (None before the first iteration)."""
        return np.mean(self._loads, axis=0) if self._loads else None

    def state_dict(self) -> dict:
        return {"w": self._loads.maxlen, "loads": [x.tolist() for x in self._loads]}

    def load_state_dict(self, state: dict) -> None:
        self._loads = collections.deque((np.asarray(x, dtype=np.float64)
                                         for x in state["loads"]), maxlen=state["w"])


def overlap_degree(non_moe_s: float, bandwidth_Bps: float, expert_bytes: int) -> int:
    """``t = T_non-MoE * bw / expert_size`` (Section 4.2), rounded down, at least 0."""
    if expert_bytes <= 0 or bandwidth_Bps <= 0:
        raise ValueError(f"overlap_degree: bandwidth {bandwidth_Bps} B/s and expert size "
                         f"{expert_bytes} B must be positive")
    return max(0, int(non_moe_s * bandwidth_Bps // expert_bytes))


def link_bandwidth(path: str, hierarchical: bool) -> float:
    """The bandwidth ``bw`` of Algorithm 1 from a ``moeflow bench links`` JSON: the inter-node
    point-to-point fit on a hierarchical cluster, else the world's (Section 4.2)."""
    from moeflow.measure.linkmodel import load_fits

    try:
        fits = load_fits(path)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as err:
        raise ConfigError(f"MoEConfig.fssdp.links={path!r} is invalid: {err}; give the JSON "
                          "written by `moeflow bench links`") from err
    keys = [("inter", "p2p")] if hierarchical else [("world", "p2p"), ("intra", "p2p")]
    for key in keys:
        if key in fits and fits[key].beta > 0:
            return 1.0 / fits[key].beta
    raise ConfigError(f"MoEConfig.fssdp.links={path!r} has no {' or '.join(map(str, keys))} "
                      "fit with a positive slope: run `moeflow bench links` on this cluster "
                      "layout")


def _apportion(total: int, weights: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """``assignSlotsByLoad``: ``total`` slots over experts proportionally to ``weights``
    (largest remainders, ties to the earlier entry), expert ``i`` at most ``caps[i]``; slots
    an expert cannot take go to the others, in proportion again."""
    caps = np.asarray(caps, dtype=np.int64)
    n = np.zeros(len(weights), dtype=np.int64)
    w = np.maximum(np.asarray(weights, dtype=np.float64), 0.0)
    if w.sum() <= 0:
        w = np.ones_like(w)
    remaining = min(int(total), int(caps.sum()))
    while remaining > 0:
        active = n < caps
        share = remaining * w * active / (w * active).sum() if (w * active).sum() > 0 \
            else remaining * active / active.sum()
        add = np.minimum(np.floor(share).astype(np.int64), caps - n)
        frac = np.where(active & (n + add < caps), share - np.floor(share), -1.0)
        for i in np.argsort(-frac, kind="stable")[:remaining - int(add.sum())]:
            if frac[i] >= 0:
                add[i] += 1
        n += add
        remaining -= int(add.sum())
        if add.sum() == 0:
            break
    return n


def _place(e: int, n: int, holders: list[set[int]], free: np.ndarray, nodes: int,
           local_size: int) -> int:
    """Distribute up to ``n`` replicas of expert ``e`` "across nodes and devices, prioritizing
    nodes with more available slots" and nodes without ``e`` (Section 4.2), one at a time; returns
    how many were placed (fewer when no device with a free slot lacks ``e``)."""
    for placed in range(n):
        best = None
        for node in range(nodes):
            devs = [d for d in range(node * local_size, (node + 1) * local_size)
                    if d not in holders[e] and free[d] > 0]
            if not devs:
                continue
            has = any(d // local_size == node for d in holders[e])
            node_free = int(free[node * local_size:(node + 1) * local_size].sum())
            dev = min(devs, key=lambda d: (-free[d], d))
            key = (has, -node_free, node)
            if best is None or key < best[0]:
                best = (key, dev)
        if best is None:
            return placed
        holders[e].add(best[1])
        free[best[1]] -= 1
    return n


def sparse_materialize(owners: Placement, loads, t: int, m, local_size: int,
                       base: Placement | None = None) -> Placement:
    """Algorithm 1. ``m``: an int (every device) or a per-device sequence of free slots;
    ``base``: the placement to extend (default ``P``; calibration passes the current ``P'``)."""
    world, E = owners.world_size, owners.num_experts
    loads = np.asarray(loads, dtype=np.float64)
    if loads.shape != (E,):
        raise ValueError(f"sparse_materialize: loads of shape {loads.shape}, expected ({E},)")
    if world % local_size:
        raise ConfigError(f"sparse_materialize local_size={local_size} must divide the world "
                          f"size {world}")
    free = np.full(world, m, dtype=np.int64) if np.isscalar(m) else np.asarray(m, np.int64)
    t = min(int(t), E)                                             # line 1
    m_all = int(free.min()) if len(free) else 0
    m_all = min(m_all, t)
    holders = [set(h) for h in (base or owners).holders]           # line 2: P' <- P
    order = sorted(range(E), key=lambda e: (-loads[e], e))
    top = order[:t]
    if t == 0:
        return owners.materialize(holders)
    if t <= m_all:                                                 # lines 3-5
        for e in top:
            holders[e] = set(range(world))
        return owners.materialize(holders)
    free = free.copy()                                             # lines 6-11
    tot_slots = int(free.sum())
    caps = np.array([world - len(holders[e]) for e in top])          # at most every device
    n_rep = _apportion(tot_slots, loads[top], caps)                   # line 9
    nodes = world // local_size
    carry = 0                          # slots an earlier expert could not use
    for e, n in zip(top, n_rep):                                   # descending load
        carry = int(n) + carry - _place(e, int(n) + carry, holders, free, nodes, local_size)
    # a slot no expert of its turn could take goes to the next candidate: sweep the top-t again
    # in descending load, one replica at a time, until every free slot sits on a device that
    # already holds every top-t expert (the budget |D| m is spent wherever it can host one)
    while free.sum() > 0 and any(_place(e, 1, holders, free, nodes, local_size) for e in top):
        pass
    return owners.materialize(holders)


def algorithm1_branch(t: int, m: int, num_experts: int) -> str:
    """Which branch of Algorithm 1 :func:`sparse_materialize` takes for scalar ``t`` and ``m``:
    ``"none"`` (``t = 0``: ``P' = P``), ``"replicate"`` (lines 3-5, ``t <= m``: the top-``t``
    experts on every device, FasterMoE's shadowing) or ``"slots_by_load"`` (lines 6-11)."""
    t = min(int(t), num_experts)
    if t == 0:
        return "none"
    return "replicate" if t <= min(int(m), t) else "slots_by_load"


def replicas_per_device(placement: Placement) -> np.ndarray:
    """Experts each device holds without owning them."""
    return np.array([len(placement.replicas(d)) for d in range(placement.world_size)])


def predicted_latency(placement: Placement, counts, local_size: int, token_s: float,
                      row_bytes: int = 0, bandwidth_Bps: float = float("inf")) -> float:
    """The forward's latency model of calibration (Section 4.2): the expert phase, the most
    loaded rank's tokens times the per-token expert time (the straggler sets the pace,
    Section 2), plus the two all-to-alls around it (dispatch and combine, Section 4.4's plan):
    the busiest rank's rows over the slow links, sent or received, times ``row_bytes`` over
    ``bandwidth_Bps`` (the inter-node links on a cluster of several nodes, every off-rank link
    on one node). ``row_bytes = 0`` leaves the all-to-all out (the expert phase alone)."""
    plan = dispatch_plan(placement, counts, local_size)
    latency = float(plan.sum(axis=(0, 1)).max()) * token_s
    if row_bytes and bandwidth_Bps != float("inf"):
        world = placement.world_size
        node = np.arange(world) // local_size
        slow = (node[:, None] != node[None, :]) if world > local_size \
            else ~np.eye(world, dtype=bool)
        rows = plan.sum(axis=1) * slow                  # [src, dst] rows over slow links
        busiest = max(rows.sum(axis=1).max(), rows.sum(axis=0).max())
        latency += 2 * float(busiest) * row_bytes / bandwidth_Bps
    return latency


def extra_gather_s(before: Placement, after: Placement, expert_bytes: int,
                   bandwidth_Bps: float) -> float:
    """The critical-path time of the extra spAG from ``before`` to ``after``: the most
    replicas a rank receives, over ``bw``."""
    extra = [len(set(after.held(d)) - set(before.held(d))) for d in range(after.world_size)]
    return max(extra) * expert_bytes / bandwidth_Bps if extra else 0.0


def calibrate(owners: Placement, current: Placement, counts, t: int, m: int, local_size: int,
              token_s: float, expert_bytes: int, bandwidth_Bps: float,
              row_bytes: int = 0) -> Placement:
    """Section 4.2's calibration: Algorithm 1 again with the real loads ``counts`` (source rank
    x expert) and the capacity left after ``current``; the new placement is accepted only if
    its predicted latency (:func:`predicted_latency`: expert phase and all-to-all, the tokens'
    ``row_bytes`` over ``bandwidth_Bps``) plus the extra spAG is below ``current``'s."""
    counts = np.asarray(counts)
    free = np.maximum(m - replicas_per_device(current), 0)
    new = sparse_materialize(owners, counts.sum(0), t, free, local_size, base=current)
    keep = predicted_latency(current, counts, local_size, token_s, row_bytes, bandwidth_Bps)
    moved = (predicted_latency(new, counts, local_size, token_s, row_bytes, bandwidth_Bps)
             + extra_gather_s(current, new, expert_bytes, bandwidth_Bps))
    return new if moved < keep else current


__all__ = ["LoadWindow", "WINDOW", "calibrate", "extra_gather_s", "link_bandwidth",
           "overlap_degree", "predicted_latency", "replicas_per_device", "sparse_materialize"]
