"""``moeflow bench links``: time point-to-point and collectives per link class, fit alpha-beta.

Link classes (groups of :class:`~moeflow.topology.Topology`): ``intra`` (the ranks of one node),
``inter`` (the ranks with the same local rank on every node), ``world``. For each class and op
(``p2p``, ``all_to_all``, ``all_gather``, ``reduce_scatter``, ``all_reduce``) and size, the ranks
align on a barrier, run the op, and a repetition's time is the slowest rank's; the median over
repetitions is fitted with ``t = alpha + beta * bytes`` (:mod:`moeflow.measure.linkmodel`, the
model of Parm section 4 and of ScheMoE's profiler).

Collectives run in every group of a class at once (as a hierarchical algorithm uses them: all
local ranks cross the node link together). ``p2p`` is one pair only (ranks 0 and 1 for intra;
rank 0 and the first rank of node 1 for inter), timed as half a ping-pong round trip, so it
shows a single flow's bandwidth. Byte conventions: see :mod:`moeflow.measure.linkmodel`.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from moeflow.measure.linkmodel import fit_record
from moeflow.measure.timing import slowest, start_aligned
from moeflow.devices import resolve_device
from moeflow.topology import Topology

OPS = ("p2p", "all_to_all", "all_gather", "reduce_scatter", "all_reduce")
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M"
_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def parse_sizes(text: str) -> list[int]:
    """``'4K,1M'`` -> [4096, 1048576] (binary K/M/G)."""
    out = []
    for item in text.split(","):
        item = item.strip().upper().removesuffix("B")
        unit = item[-1] if item and item[-1] in _UNITS else ""
        try:
            value = float(item[:-1] if unit else item) * _UNITS[unit]
        except ValueError:
            value = -1
        if value < 1:
            raise ValueError(f"--sizes item {item!r} is invalid: write byte counts like "
                             "4K,64K,1M,16M")
        out.append(int(value))
    return sorted(set(out))


def _groups(topo: Topology) -> list[tuple[str, object, int, int]]:
    """(class, this rank's group, group size, concurrent groups) for the distinct classes."""
    out = []
    if topo.local_size > 1:
        out.append(("intra", topo.intra_node_group, topo.local_size, topo.num_nodes))
    if topo.num_nodes > 1:
        out.append(("inter", topo.inter_node_group, topo.num_nodes, topo.local_size))
    if topo.local_size > 1 and topo.num_nodes > 1:
        out.append(("world", topo.world_group, topo.world_size, 1))
    return out


def _collective(op: str, group, g: int, nbytes: int, device: torch.device):
    """A closure running ``op`` on ``nbytes`` (nccl-tests convention) over ``group``."""
    n = max(g, nbytes // 4 // g * g)           # float32 elements, a multiple of g
    big = torch.ones(n, device=device)
    small = torch.ones(n // g, device=device)
    out_big = torch.empty(n, device=device)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(out_big, big, group=group)
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out_big, small, group=group)
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(small, big, group=group)
    if op == "all_reduce":
        return lambda: dist.all_reduce(big, group=group)
    raise ValueError(op)


def _ping_pong(a: int, b: int, nbytes: int, device: torch.device):
    buf = torch.ones(max(1, nbytes // 4), device=device)
    me = dist.get_rank()

    def run():
        if me == a:
            dist.send(buf, b)
            dist.recv(buf, b)
        elif me == b:
            dist.recv(buf, a)
            dist.send(buf, a)
    return run


def _time(run, warmup: int, reps: int, nbytes: int, topo: Topology, device: torch.device,
          scale: float = 1.0) -> float:
    """Median of the slowest rank's time (CUDA events on GPUs); 3x the repetitions below 1 MiB
    (cheap, noisier)."""
    times = []
    if nbytes < (1 << 20):
        reps *= 3
    for i in range(warmup + reps):
        watch = start_aligned(topo, device)
        run()
        elapsed = slowest(watch.stop(), topo)
        if i >= warmup:
            times.append(elapsed * scale)
    return statistics.median(times)


def links_worker(sizes: list[int], warmup: int, reps: int,
                 device: str = "cpu") -> dict | None:
    """On every rank: measure everything with buffers on ``device``; rank 0 returns
    ``{"layout", "fits"}``, others None."""
    topo = Topology.from_env()
    dev = resolve_device(device)
    if not topo.distributed:
        raise ValueError("moeflow bench links needs at least 2 ranks: start it under "
                         "`moeflow cluster run` or torchrun, or pass --nproc 2")
    fits = []
    for cls, group, g, concurrent in _groups(topo):
        for op in OPS:
            points = []
            for nbytes in sizes:
                if op == "p2p":
                    peer = 1 if cls == "intra" else topo.local_size
                    if cls == "world":
                        continue
                    run = _ping_pong(0, peer, nbytes, dev)
                    points.append((max(4, nbytes // 4 * 4),
                                   _time(run, warmup, reps, nbytes, topo, dev, 0.5)))
                else:
                    run = _collective(op, group, g, nbytes, dev)
                    n = max(g, nbytes // 4 // g * g)
                    points.append((4 * n, _time(run, warmup, reps, nbytes, topo, dev)))
            if len(points) >= 2:
                fits.append(fit_record(cls, op, 2 if op == "p2p" else g,
                                       1 if op == "p2p" else concurrent, points))
    if topo.rank != 0:
        return None
    return {"layout": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size,
                       "world": topo.world_size}, "fits": fits}


def format_table(fits: list[dict]) -> str:
    head = (f"{'group':6} {'op':15} {'g':>3} {'alpha us':>9} {'1/beta MB/s':>12} "
            f"{'R2':>7} {'max err':>8} {'largest':>9} {'t ms':>9} {'MB/s':>8}")
    lines = [head, "-" * len(head)]
    for r in fits:
        big, t = r["points"][-1]
        lines.append(f"{r['group']:6} {r['op']:15} {r['group_size']:>3} "
                     f"{r['alpha_s'] * 1e6:>9.1f} {(r['bandwidth_Bps'] or math.inf) / 1e6:>12.1f} "
                     f"{r['r2']:>7.4f} {r['max_rel_err'] * 100:>7.1f}% "
                     f"{_fmt_bytes(big):>9} {t * 1e3:>9.2f} {big / t / 1e6:>8.1f}")
    return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("G", 1024 ** 3), ("M", 1024 ** 2), ("K", 1024)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"
