"""``MoEConfig.fssdp.transport="auto"``: time spAG + spRS with each transport, once.

HECATE Section 3.1 defines spAG / spRS by their placements only; the prototype moves chunks by
grouped broadcasts and reduces (Section 5, "Implementation"), moeflow by point-to-point by
default (:mod:`moeflow.comm.sparse`). Which is faster depends on the link and on how many
holders each expert has, so ``auto`` measures both on the layer's first materialized placement
that replicates an expert, with its real expert rows: ``warmup`` untimed rounds, then ``reps``
rounds each running the two transports one after the other (interleaved, so drifting load hits
both alike). A round's time on a rank covers its spAG and the mirror spRS; the ranks' times are
max-reduced (the slowest rank is what the iteration waits for) in one bounded all-reduce, so
every rank gets the same numbers and takes the same decision.

On CUDA every holder set the broadcast transport uses is an NCCL communicator (device memory on
each member, an eager split that stops every rank: :mod:`moeflow.comm.holder_groups`), so
``auto`` times it only for few, stable holder sets (:func:`broadcast_candidate`): a P' the user
fixed (``materialize="manual"``) with at most :data:`AUTO_MAX_HOLDER_SETS` replicated sets that
fit the cache. Algorithm 1's P' changes with the loads, so each new set would cost a
communicator mid-training: ``auto`` keeps p2p there without timing.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from moeflow.comm.sparse import SparseAllGather, SparseReduceScatter, group_timeout, wait_work
from moeflow.strategies.fssdp.placement import Placement


AUTO_MAX_HOLDER_SETS = 4       # distinct replicated holder sets auto lets broadcast take


def broadcast_candidate(placement: Placement, materialize: str, groups) -> str | None:
    """Why ``auto`` must keep p2p without timing the broadcast transport over ``placement``
    (None: time both). ``groups``: the layer's :class:`~moeflow.comm.holder_groups.HolderGroups`.
    The same answer on every rank (a function of the config and of P')."""
    sets = {frozenset(h) for h in placement.holders if len(h) > 1}
    if materialize != "manual":
        return (f"materialize={materialize!r}: P' follows the loads, so its holder sets (and "
                "their communicators) would change during training")
    if len(sets) > AUTO_MAX_HOLDER_SETS:
        return (f"{len(sets)} distinct holder sets, more than {AUTO_MAX_HOLDER_SETS} (one "
                "communicator each)")
    if groups is None or not groups.fits(sets):
        return "the holder sets do not fit the cache of holder groups (max_groups)"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":        # setup only (once per layer), not the hot path
        torch.cuda.synchronize(device)


def time_transports(owners: Placement, placement: Placement, owned: dict[int, torch.Tensor],
                    group, groups, *, warmup: int = 1, reps: int = 3) -> tuple[float, float]:
    """Collective on ``group``: the median over ``reps`` of the slowest rank's spAG + spRS
    seconds over ``placement``, as ``(p2p, broadcast)``. ``owned``: this rank's expert rows
    (``{expert: (numel,)}``); ``groups``: the broadcast transport's holder groups."""
    rank = dist.get_rank(group)
    some = next(iter(owned.values()), None)
    if some is None:                   # a rank owning no expert (never under FSSDP's even map)
        raise ValueError("time_transports needs this rank's owned expert rows")
    shape, dtype, device = some.shape, some.dtype, some.device
    p0, p1 = owners.owner_chunks(), placement.holder_chunks()
    held = placement.held(rank)
    grads = {e: (owned[e] if e in owned else torch.zeros(shape, dtype=dtype, device=device))
             for e in held}
    ops = {}
    for name, g in (("p2p", None), ("broadcast", groups)):
        ops[name] = (SparseAllGather(p0, p1, shape, dtype, group=group, device=device,
                                     verify=False, transport=name, groups=g),
                     SparseReduceScatter(p1, p0, shape, dtype, group=group, device=device,
                                         verify=False, transport=name, groups=g))
    times = {name: [] for name in ops}
    for i in range(warmup + reps):
        for name, (ag, rs) in ops.items():
            _sync(device)
            t0 = time.perf_counter()
            ag(owned)
            rs(grads)
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    mine = torch.tensor(times["p2p"] + times["broadcast"], dtype=torch.float64,
                        device=device)
    wait_work(dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group, async_op=True),
              group_timeout(group), device)
    slowest = mine.tolist()
    return statistics.median(slowest[:reps]), statistics.median(slowest[reps:])


__all__ = ["AUTO_MAX_HOLDER_SETS", "broadcast_candidate", "time_transports"]
