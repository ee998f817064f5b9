"""Aligned timing, shared by the auto-tuner, Parm's fits and the benchmarks: ranks start a
repetition together, the work is timed on its device (:class:`moeflow.devices.Stopwatch`: CUDA
events on CUDA, the host clock on CPU), and a repetition's time is the slowest rank's."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from moeflow.devices import Stopwatch, host_all_reduce, synchronize

# ``topo`` below is a moeflow.topology.Topology (only ``distributed`` and ``world_group`` are
# read); it is not imported so that this core module stays below the topology and the layer.


def layer_step(layer, x: torch.Tensor, **call) -> None:
    """One forward + backward of an MoE layer as its tuners time it (the auto-tuner, its
    schedule profiler, Parm's measured ``auto``): the loss ``mean(y^2)`` in float32 plus the
    layer's aux loss; ``call``: the layer's per-call options (``top_k``, ``capacity_factor``)."""
    y = layer(x, **call)
    (y.float().square().mean() + layer.aux_loss).backward()


def slowest(seconds: float, topo: "Topology") -> float:
    """The maximum of ``seconds`` over all ranks (itself on a world of one); a host-side
    collective that works on any group (gloo, or ``cpu:gloo,cuda:nccl``)."""
    if not topo.distributed:
        return seconds
    return host_all_reduce([seconds], "max", topo.world_group)[0]


def start_aligned(topo: "Topology", device: torch.device) -> Stopwatch:
    """Wait for this rank's queued work, align the ranks on a barrier, start a stopwatch."""
    synchronize(device)
    if topo.distributed:
        dist.barrier()
    return Stopwatch(device).start()


def time_aligned(fn: Callable[[], object], topo: "Topology", device: torch.device) -> float:
    """Run ``fn`` once with the ranks aligned; return the slowest rank's time of it."""
    watch = start_aligned(topo, device)
    fn()
    return slowest(watch.stop(), topo)


def inter_node_seconds_per_byte(topo: "Topology", device: torch.device,
                                nbytes: int = 1 << 20) -> float:
    """Seconds per byte a rank sends to other nodes, the node's other ranks sending at the same
    time (as in an exchange: they share the node's link): one warm-up and one timed
    ``all_to_all_single`` of ``nbytes`` per peer over ``topo.inter_node_group``, the slowest
    rank's time over the bytes sent to other nodes (the alpha-beta model's beta, with its
    alpha folded in: Parm section 4). Collective over the world; 0.0 on one node."""
    N = topo.num_nodes
    if N < 2 or not topo.distributed:
        return 0.0
    n = max(1, nbytes // 4)
    send = torch.zeros(N * n, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    group = topo.inter_node_group
    t = 0.0
    for _ in range(2):                       # the first is a warm-up
        t = time_aligned(lambda: dist.all_to_all_single(recv, send, group=group), topo, device)
    return t / (4 * n * (N - 1))


def paired_times(step_a: Callable[[], float], step_b: Callable[[], float], pairs: int, fits,
                 warmup: bool = True) -> tuple[list[float], list[float]]:
    """Time ``pairs`` interleaved pairs (a, b, a, b, ...): ``step_a()`` and ``step_b()`` each
    return one step's seconds (the slowest rank's), so a slow spell of a shared machine falls
    on both of a pair. With ``warmup``, one step of each first (not returned). Before each pair
    after the first, ``fits(2)`` (collective, the same answer on every rank) says whether two
    more steps fit the time budget; when not, the pairs so far are returned. Used by the
    auto-tuner's placement screen and Parm's measured ``auto``."""
    if warmup:
        step_a(), step_b()                      # allocations, a newly applied setting
    a, b = [], []
    for i in range(pairs):
        if i > 0 and not fits(2):
            break
        a.append(step_a())
        b.append(step_b())
    return a, b
