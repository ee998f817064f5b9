"""Topology-aware token dispatch over a materialized placement (HECATE, Section 4.4).

With sparse materialization an expert may be held by several ranks, so every (token, expert)
choice must pick one holder. Section 4.4's rule, applied per source rank ``s`` and expert ``e``:

1. if ``s`` holds ``e``, all of its tokens for ``e`` stay local;
2. otherwise they go to the holders on ``s``'s node (intra-node links are fast);
3. only when no rank of ``s``'s node holds ``e`` do they cross nodes, to all holders;

"evenly distributing the tokens among the selected devices": ``n`` tokens over ``k`` candidates
give ``n // k`` to each and one more to ``n % k`` of them, starting at candidate ``s mod k`` so
that the remainders of different source ranks land on different holders.

Rank ``r`` lives on node ``r // local_size`` (as :mod:`moeflow.topology`). Every rank knows the
count matrix after the count exchange (:mod:`moeflow.comm.exchange`), so each one computes the
same plan on the host without messages.
"""

from __future__ import annotations

import numpy as np

from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.placement import Placement


def candidates(placement: Placement, src: int, expert: int, local_size: int) -> list[int]:
    """The holders of ``expert`` that tokens from ``src`` may go to (Section 4.4), ascending."""
    holders = placement.holders[expert]
    if src in holders:
        return [src]
    node = src // local_size
    same = sorted(d for d in holders if d // local_size == node)
    return same if same else sorted(holders)


def _check_layout(placement: Placement, local_size: int) -> None:
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 \
            or placement.world_size % local_size:
        raise ConfigError(f"dispatch local_size={local_size!r} is invalid: it must be a "
                          f"positive divisor of the world size {placement.world_size} "
                          "(nodes x ranks per node)")


def dispatch_plan(placement: Placement, counts, local_size: int) -> np.ndarray:
    """``plan[s, e, d]``: tokens rank ``s`` sends to rank ``d`` for expert ``e``.

    counts: ``(world, E)`` integers, ``counts[s, e]`` = tokens rank ``s`` routes to expert ``e``.
    ``plan.sum(2) == counts`` and ``plan[s, e, d] > 0`` only for a holder ``d`` of ``e``.
    """
    _check_layout(placement, local_size)
    counts = np.asarray(counts)
    world, num_experts = placement.world_size, placement.num_experts
    if counts.shape != (world, num_experts) or not np.issubdtype(counts.dtype, np.integer) \
            or (counts < 0).any():
        raise ConfigError(f"dispatch counts of shape {counts.shape} and dtype {counts.dtype} "
                          f"are invalid: give non-negative integers of shape ({world}, "
                          f"{num_experts}) (source rank x expert)")
    plan = np.zeros((world, num_experts, world), dtype=np.int64)
    for s in range(world):
        for e in range(num_experts):
            n = int(counts[s, e])
            cand = candidates(placement, s, e, local_size)
            k = len(cand)
            base, rem = divmod(n, k)
            for j, d in enumerate(cand):
                plan[s, e, d] = base + (1 if (j - s) % k < rem else 0)
    return plan


def rank_loads(plan: np.ndarray) -> np.ndarray:
    """Tokens each rank computes under ``plan`` (``plan.sum((0, 1))``)."""
    return np.asarray(plan).sum(axis=(0, 1))


__all__ = ["candidates", "dispatch_plan", "rank_loads"]
