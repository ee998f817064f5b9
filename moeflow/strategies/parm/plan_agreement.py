"""A debug check that the MP ranks hold one dispatch plan, as Parm's S2 assumes.

S2 (Parm Fig. 3c, Eq. 7 / 14) gates the MoE input, which is replicated over the MP group, on
every MP rank, and then MP-splits one send buffer between them: each rank sends its share of
*the same* plan and the MP-AllGather reassembles it. If the ranks routed differently (gate
noise drawn per rank, a non-deterministic kernel, a router whose state diverged), the shares
would belong to different plans and the layer's output would be silently wrong.
:func:`check_plan_agrees` compares a digest of the plan over the MP group: one host
synchronisation and one small all-reduce, so it is off by default in training
(``MoEConfig.parm_check_plan``) and on in the parity tests.
"""

from __future__ import annotations

import torch

from moeflow.devices import host_all_reduce
from moeflow.dispatch.plan import DispatchPlan
from moeflow.topology import Topology

_MOD = 2_147_483_647            # digests stay exact in the float64 host all-reduce


def _mix(i: torch.Tensor, seed: int) -> torch.Tensor:
    """A pseudo-random, non-linear weight per position (a 32-bit integer hash)."""
    r = (i * seed) % 2**32
    r = r ^ (r >> 16)
    r = (r * 0x45D9F3B) % 2**32
    return (r ^ (r >> 16)) % _MOD


def plan_digest(plan: DispatchPlan) -> list[float]:
    """Three numbers that differ, but for a vanishing chance, between two different plans: the
    row each routing choice takes (or the choice each row holds, dropless) hashed with two
    pseudo-random weights per position, modulo a prime."""
    s = (plan.slot.reshape(-1).to(torch.int64) + 1) % _MOD
    i = torch.arange(1, s.numel() + 1, device=s.device, dtype=torch.int64)
    d = [(s * _mix(i, seed) % _MOD).sum() % _MOD for seed in (0x9E3779B1, 0x85EBCA6B)]
    return [float(s.numel()), *map(float, torch.stack(d).tolist())]


def check_plan_agrees(plan: DispatchPlan, topo: Topology) -> None:
    """RuntimeError on every MP rank (none waits) if the MP ranks' plans differ."""
    if topo.mp_size == 1:
        return
    mine = plan_digest(plan)
    both = host_all_reduce(mine + [-v for v in mine], "max", topo.mp_group)
    high, low = both[:3], [-v for v in both[3:]]
    if high != low:
        raise RuntimeError(
            f"Parm: the MP ranks' dispatch plans differ (MP group of rank {topo.rank}, "
            f"digests between {low} and {high}): S2 splits one plan over the MP group, and "
            "the baseline with the ESP group inside the MP group sums the shards of each "
            "peer's own copy, so every MP rank must route its (replicated) tokens identically. "
            "Check the router for per-rank randomness or state, or use parallel_schedule='s1'")
