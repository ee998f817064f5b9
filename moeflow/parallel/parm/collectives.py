"""Parm's ESP data movements as autograd functions, each with its conjugate backward.

Parm Section II-B / Fig. 3a: ESP-AllGather before the EP-AlltoAll, ESP-AllReduce of the expert
shards' partial outputs, ESP-Split after the second EP-AlltoAll. The pairs (as in Megatron's
mappings): AllGather -> ReduceScatter (each rank's input gradient is partial), AllReduce ->
identity (its output is replicated, so is its gradient), Split -> AllGather ("the split
operations ... introduce the AllGather communication in backpropagation", Fig. 3 caption).
Row counts may differ per rank (dropless, or capacity from unequal local batches): blocks are
padded to the largest and cut after the collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.10 names them *_single (the *_tensor names warn there)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows,) + tuple(x.shape[1:]))
    out[:x.shape[0]] = x
    return out


def _gather(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Rows of every rank of ``group``, in group-rank order (``sizes[i]`` from rank i)."""
    top = max(sizes)
    buf = x.new_empty((len(sizes) * top,) + tuple(x.shape[1:]))
    _all_gather(buf, _padded(x, top), group=group)
    return torch.cat([buf[i * top:i * top + n] for i, n in enumerate(sizes)])


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, me, group):
        ctx.sizes, ctx.me, ctx.group = sizes, me, group
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        sizes, top = ctx.sizes, max(ctx.sizes)
        blocks = torch.split(g.contiguous(), sizes)
        padded = torch.cat([_padded(b, top) for b in blocks])
        out = g.new_empty((top,) + tuple(g.shape[1:]))
        _reduce_scatter(out, padded, group=ctx.group)
        return out[:sizes[ctx.me]], None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, sizes, me, group):
        ctx.sizes, ctx.me, ctx.group = sizes, me, group
        return y.narrow(0, sum(sizes[:me]), sizes[me]).clone()

    @staticmethod
    def backward(ctx, g):
        return _gather(g.contiguous(), ctx.sizes, ctx.group), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def esp_all_gather(x: torch.Tensor, sizes: list[int], me: int, group) -> torch.Tensor:
    """ESP-AllGather of rows: ``sizes[i]`` rows from group rank i (this rank is ``me``).
    Backward: ReduceScatter (the sum of every rank's gradient of this rank's block)."""
    return _AllGather.apply(x, list(sizes), me, group)


def esp_split(y: torch.Tensor, sizes: list[int], me: int, group) -> torch.Tensor:
    """ESP-Split: this rank's block of the rows ``y`` (equal on every rank of ``group``).
    Backward: AllGather of the blocks' gradients."""
    return _Split.apply(y, list(sizes), me, group)


def esp_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """ESP-AllReduce (sum) of partial outputs. Backward: identity (the sum is replicated)."""
    return _AllReduce.apply(x, group)
