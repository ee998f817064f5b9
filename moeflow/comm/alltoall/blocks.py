"""Split bookkeeping shared by the multi-step all-to-all algorithms.

``split_matrix`` gathers every rank's send splits so that each rank knows the whole matrix
``S[i][j]`` (rows rank i sends to rank j) and can compute the layouts of intermediate steps
without further messages. ``take`` cuts row blocks out of a tensor and concatenates them in a
new order (no Python loop over rows).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def split_matrix(send_splits: list[int], group, device: torch.device) -> list[list[int]]:
    """All-gather the send splits of every rank of ``group``: ``S[src][dst]``."""
    n = len(send_splits)
    mine = torch.tensor(send_splits, dtype=torch.long, device=device)
    rows = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(rows, mine, group=group)
    return torch.stack(rows).tolist()


def offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def take(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Blocks of ``x`` (consecutive, of ``sizes``) re-concatenated in ``order``."""
    off = offsets(sizes)
    parts = [x.narrow(0, off[i], sizes[i]) for i in order if sizes[i]]
    if not parts:
        return x.new_empty((0,) + tuple(x.shape[1:]))
    return torch.cat(parts)
