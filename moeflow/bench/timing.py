"""Timing helpers shared by the benchmarks: a repetition's time is the slowest rank's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.topology import Topology


def slowest(seconds: float, topo: Topology) -> float:
    """The maximum of ``seconds`` over all ranks (itself on a world of one)."""
    if not topo.distributed:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)
