"""``moeflow bench spag``: SparseAllGather as batched point-to-point (moeflow's, Section 3.1)
against the paper prototype's grouped broadcasts (Section 5, "Implementation": one Broadcast
per chunk from its owner to its holders, in a group per holder set), side by side.

The broadcast variant needs a process group per distinct holder set; the groups are created
once before timing (``new_group`` is a world collective, which is why moeflow's FSSDP, whose
``P'`` changes every iteration, uses point-to-point). Both variants move the same chunks; the
time of a repetition is the slowest rank's; medians of round-robin repetitions.
"""

from __future__ import annotations

import statistics

import numpy as np
import torch
import torch.distributed as dist

from moeflow.measure.timing import slowest, start_aligned
from moeflow.comm.sparse import SparseAllGather, group_timeout
from moeflow.placement.placement import Placement
from moeflow.topology import Topology


def random_holders(num_experts: int, world: int, owners: Placement, replicas: int,
                   seed: int) -> list[set[int]]:
    """Each expert held by its owner plus up to ``replicas`` random other ranks."""
    rng = np.random.default_rng(seed)
    out = []
    for e in range(num_experts):
        others = [r for r in range(world) if r != owners.owners[e]]
        k = int(rng.integers(0, min(replicas, len(others)) + 1))
        out.append({owners.owners[e], *rng.choice(others, size=k, replace=False).tolist()})
    return out


def bench_worker(opts: dict) -> dict:
    topo = Topology.from_env()
    world, rank = topo.world_size, topo.rank
    E = opts["experts_per_rank"] * world
    numel = opts["chunk_bytes"] // 4
    owners = Placement.even(E, world)
    rows = []
    for replicas in opts["replicas"]:
        holders = random_holders(E, world, owners, replicas, seed=11 + replicas)
        p1 = owners.materialize(holders)
        mine = {e: torch.full((numel,), float(e)) for e in owners.owned(rank)}
        p2p = SparseAllGather(owners.owner_chunks(), p1.holder_chunks(), (numel,),
                              torch.float32, group=topo.world_group, verify=False)
        groups = {}
        for e, h in enumerate(holders):          # every rank creates every group, in order
            key = tuple(sorted(h))
            if len(key) > 1 and key not in groups:
                groups[key] = dist.new_group(list(key))
        bufs = {e: (mine[e] if e in mine else torch.empty(numel))
                for e, h in enumerate(holders) if rank in h}
        timeout = group_timeout(topo.world_group)

        def broadcast():
            works = [dist.broadcast(bufs[e], src=owners.owners[e], group=groups[tuple(sorted(h))],
                                    async_op=True)
                     for e, h in enumerate(holders) if len(h) > 1 and rank in h]
            for w in works:
                w.wait(timeout)

        def point_to_point():
            p2p(mine)

        times = {"batched p2p": [], "grouped broadcast": []}
        fns = {"batched p2p": point_to_point, "grouped broadcast": broadcast}
        for i in range(opts["warmup"] + opts["reps"]):
            for name, fn in fns.items():
                watch = start_aligned(topo, torch.device("cpu"))
                fn()
                t = slowest(watch.stop(), topo)
                if i >= opts["warmup"]:
                    times[name].append(t)
        moved = sum((len(h) - 1) * opts["chunk_bytes"] for h in holders)
        base = statistics.median(times["batched p2p"])
        for name, ts in times.items():
            ms = 1e3 * statistics.median(ts)
            rows.append({"max_replicas": replicas, "variant": name, "ms": ms,
                         "vs_p2p": 1e3 * base / ms, "bytes_moved": moved,
                         "samples_ms": [1e3 * t for t in ts]})
        for g in groups.values():
            dist.destroy_process_group(g)
    return {"topology": repr(topo), "options": opts, "rows": rows}


def format_result(res: dict) -> str:
    lines = [res["topology"], f"{'replicas':>8} {'variant':<18} {'ms':>9} {'p2p speed':>9} "
                              f"{'MB moved':>9}", "-" * 58]
    for r in res["rows"]:
        lines.append(f"{r['max_replicas']:>8} {r['variant']:<18} {r['ms']:>9.2f} "
                     f"{r['vs_p2p']:>8.2f}x {r['bytes_moved'] / 1e6:>9.2f}")
    return "\n".join(lines)


__all__ = ["bench_worker", "format_result", "random_holders"]
