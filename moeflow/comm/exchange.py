"""Exchanging split sizes before a variable-size all-to-all ("counts travel first")."""

from __future__ import annotations

import torch

from moeflow.comm.alltoall.base import AllToAll


def exchange_counts(counts: torch.Tensor, algo: AllToAll) -> torch.Tensor:
    """Send ``counts[j*n:(j+1)*n]`` to rank j; return what every rank sent us, source-major.

    Used before every exchange so each rank knows how many rows it will receive from whom.
    """
    p = algo.topo.ep_size
    n = counts.numel() // p
    return algo.exchange(counts.contiguous(), [n] * p, [n] * p)
