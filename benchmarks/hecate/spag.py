"""``moeflow bench spag``: HECATE's SparseAllGather and SparseReduceScatter with moeflow's two
transports side by side (``MoEConfig.fssdp.transport``, :mod:`moeflow.comm.sparse`): batched
point-to-point from the owner to each holder, and the paper prototype's grouped broadcasts /
reduces (Section 5, "Implementation": one Broadcast per chunk from its owner in the group of its
holders, spRS the mirror Reduce).

The broadcast transport's groups (one per distinct holder set, :mod:`moeflow.comm.holder_groups`)
are created before timing, as FSSDP caches them after the first iteration. Both transports move
the same chunks. Each repetition runs spAG p2p, spAG broadcast, spRS p2p, spRS broadcast one after
the other (interleaved), with the ranks aligned; a repetition's time is the slowest rank's.
Reported: min / median / max over repetitions, and the per-repetition ratio p2p / broadcast
(paired: the same repetition), min / median / max.
"""

from __future__ import annotations

import statistics

import numpy as np
import torch

from moeflow.comm.holder_groups import HolderGroups
from moeflow.comm.sparse import SparseAllGather, SparseReduceScatter, group_timeout
from moeflow.measure.timing import slowest, start_aligned
from moeflow.strategies.fssdp.placement import Placement
from moeflow.topology import Topology

TRANSPORTS = ("p2p", "broadcast")


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
    groups = HolderGroups(topo.world_group, group_timeout(topo.world_group))
    dev = torch.device("cpu")
    rows = []
    for replicas in opts["replicas"]:
        holders = random_holders(E, world, owners, replicas, seed=11 + replicas)
        p0, p1 = owners.owner_chunks(), owners.materialize(holders).holder_chunks()
        mine = {e: torch.full((numel,), float(e)) for e in owners.owned(rank)}
        held = {e: torch.full((numel,), float(rank)) for e, h in enumerate(holders) if rank in h}
        ops = {}
        for t in TRANSPORTS:           # the broadcast groups are created here, untimed
            g = groups if t == "broadcast" else None
            ops["spAG", t] = (SparseAllGather(p0, p1, (numel,), torch.float32,
                                              group=topo.world_group, verify=False,
                                              transport=t, groups=g), mine)
            ops["spRS", t] = (SparseReduceScatter(p1, p0, (numel,), torch.float32,
                                                  group=topo.world_group, verify=False,
                                                  transport=t, groups=g), held)
        times = {key: [] for key in ops}
        for i in range(opts["warmup"] + opts["reps"]):
            for key, (op, chunks) in ops.items():
                watch = start_aligned(topo, dev)
                op(chunks)
                t = slowest(watch.stop(), topo)
                if i >= opts["warmup"]:
                    times[key].append(t)
        moved = sum((len(h) - 1) * opts["chunk_bytes"] for h in holders)
        for op in ("spAG", "spRS"):
            base = times[op, "p2p"]
            for t in TRANSPORTS:
                ts = times[op, t]
                ratio = [a / b for a, b in zip(base, ts)]
                rows.append({"max_replicas": replicas, "op": op, "variant": t,
                             "ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
                             "max_ms": 1e3 * max(ts),
                             "p2p_over_this": statistics.median(ratio),
                             "p2p_over_this_min": min(ratio), "p2p_over_this_max": max(ratio),
                             "bytes_moved": moved, "samples_ms": [1e3 * x for x in ts]})
    return {"topology": repr(topo), "options": opts, "groups_created": groups.created,
            "rows": rows}


def format_result(res: dict) -> str:
    lines = [res["topology"], f"{'replicas':>8} {'op':<5} {'transport':<10} {'median ms':>9} "
                              f"{'min':>7} {'max':>7} {'p2p/this (min..max)':>22} "
                              f"{'MB moved':>9}", "-" * 86]
    for r in res["rows"]:
        lines.append(f"{r['max_replicas']:>8} {r['op']:<5} {r['variant']:<10} {r['ms']:>9.2f} "
                     f"{r['min_ms']:>7.2f} {r['max_ms']:>7.2f} "
                     f"{r['p2p_over_this']:>8.2f} ({r['p2p_over_this_min']:.2f}.."
                     f"{r['p2p_over_this_max']:.2f}) {r['bytes_moved'] / 1e6:>9.2f}")
    return "\n".join(lines)


__all__ = ["bench_worker", "format_result", "random_holders"]
