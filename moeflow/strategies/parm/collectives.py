"""Parm's ESP data movements as autograd functions, each with its conjugate backward.

Parm Section II-B / Fig. 3a: ESP-AllGather before the EP-AlltoAll, ESP-AllReduce of the expert
shards' partial outputs, ESP-Split after the second EP-AlltoAll. The pairs (as in Megatron's
mappings): AllGather -> ReduceScatter (each rank's input gradient is partial), AllReduce ->
identity (its output is replicated, so is its gradient), Split -> AllGather ("the split
operations ... introduce the AllGather communication in backpropagation", Fig. 3 caption).
MP movements of the Parm schedules (Section III-B, PauseMP): MP-Split keeps this MP rank's
part of a tensor replicated over the MP group; its backward is the AllGather of the parts'
gradients, averaged over the group (each MP rank's loss counts, so the AllGather's backward, a
reduce-scatter sum, hands a part N_MP replicas' gradients; the mean gives back one replica's,
what the replicated input of a tensor-parallel layer expects). MP-AllGather's backward is the
reduce-scatter (sum); the baseline's MP-AllGather (DeepSpeed-MoE's ``gather_tokens``) takes
this rank's block of the replicated gradient instead, scaled by N_MP (the same value without
the collective). The EP&ESP-AlltoAll's backward is the all-to-all the other way.
Row counts may differ per rank (dropless, or capacity from unequal local batches): blocks are
padded to the largest and cut after the collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.schedule.executor import on_lane

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
        # inside task E of a running schedule: a task of its communication lane, queued behind
        # the all-to-alls already issued (one collective order per rank, executor.on_lane)
        on_lane(lambda: dist.all_reduce(y, group=group), y)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ReplicaGrad(torch.autograd.Function):
    """Identity forward; backward: the output gradient times ``n``."""

    @staticmethod
    def forward(ctx, y, n):
        ctx.n = n
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.n, None


class EspReduce:
    """The ESP-AllReduce of an ``ExpertFFN(reduce=...)``'s shard partials (Fig. 3a).

    ``replicated=False``: the shards compute rows gathered over the ESP group (Eq. 1's
    ESP-AllGather), the output is replicated and so is its gradient after ESP-Split's backward
    (an AllGather): the all-reduce's backward is the identity and nothing else is needed.

    ``replicated=True``: the ESP group lies inside the MP group, so its ranks hold the same
    rows and each sends its own copy to its own shards (DeepSpeed-MoE 0.8.1 with
    tensor-parallel experts: no ESP-AllGather). This is Megatron's pair: the all-reduce
    ``g`` (backward: identity) after the shards, and ``f`` before them, whose backward
    all-reduces the shards' partial input gradients (:meth:`input_grad`, issued by the
    schedule's lane inside the experts' backward task). The output gradient is the same on
    every peer (the tensor-parallel invariant of the MP group), and each MP rank's loss counts
    (moeflow's loss is the mean of the ranks' losses), so each peer's output carries the
    ``N_ESP`` peers' equal gradients: :meth:`output` scales the gradient by ``N_ESP`` (the
    all-reduce of the output gradients, without the collective), the shards' weights (b2
    included) get every peer's contribution, and :meth:`input_grad` takes the mean. The
    gradients are then those of the gathered schedule, bit for bit up to the order of sums.
    """

    def __init__(self, group, size: int, replicated: bool):
        self.group, self.size, self.replicated = group, size, replicated

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        return esp_all_reduce(partial, self.group)

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """The experts' output (b2 added): with replicated rows, gradient times ``N_ESP``."""
        return _ReplicaGrad.apply(y, self.size) if self.replicated else y

    def input_grad(self, g: torch.Tensor) -> torch.Tensor:
        """The shards' partial input gradient -> the whole one (replicated rows: the mean over
        the ESP group, Megatron's ``f`` backward), issued on the schedule's lane."""
        if not self.replicated:
            return g
        g = g.contiguous()
        on_lane(lambda: dist.all_reduce(g, group=self.group), g)
        return g.div_(self.size)


def esp_all_gather(x: torch.Tensor, sizes: list[int], me: int, group) -> torch.Tensor:
    """ESP-AllGather of rows: ``sizes[i]`` rows from group rank i (this rank is ``me``).
    Backward: ReduceScatter (the sum of every rank's gradient of this rank's block)."""
    return _AllGather.apply(x, list(sizes), me, group)


def esp_split(y: torch.Tensor, sizes: list[int], me: int, group) -> torch.Tensor:
    """ESP-Split: this rank's block of the rows ``y`` (equal on every rank of ``group``).
    Backward: AllGather of the blocks' gradients."""
    return _Split.apply(y, list(sizes), me, group)


def esp_reduce_scatter(x: torch.Tensor, sizes: list[int], me: int, group) -> torch.Tensor:
    """ESP-ReduceScatter of rows: the sum over ``group`` of every rank's ``x`` (blocks of
    ``sizes`` rows, the same on every rank), this rank's block. Backward: AllGather."""
    return _ReduceScatter.apply(x, list(sizes), me, group)


def esp_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """ESP-AllReduce (sum) of partial outputs. Backward: identity (the sum is replicated).
    Called inside a scheduled task (task E), it is issued by the schedule's communication lane
    (:func:`moeflow.schedule.executor.on_lane`), never beside the lane's all-to-alls."""
    return _AllReduce.apply(x, group)


def _reduce_scatter_rows(g: torch.Tensor, sizes: list[int], me: int, group) -> torch.Tensor:
    """Sum over ``group`` of every rank's ``g`` (blocks of ``sizes`` rows), this rank's block."""
    top = max(sizes)
    padded = torch.cat([_padded(b, top) for b in torch.split(g.contiguous(), sizes)])
    out = g.new_empty((top,) + tuple(g.shape[1:]))
    _reduce_scatter(out, padded, group=group)
    return out[:sizes[me]]


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, me, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_rows(x, sizes, me, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g.contiguous(), ctx.sizes, ctx.group), None, None, None


class _MPGatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, me, group):
        ctx.sizes, ctx.me = sizes, me
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        sizes, me = ctx.sizes, ctx.me
        return g.narrow(0, sum(sizes[:me]), sizes[me]) * len(sizes), None, None, None


class _MPSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, me, group):
        ctx.rows, ctx.me, ctx.group, ctx.n = rows, me, group, x.shape[0]
        return x.index_select(0, rows[me])

    @staticmethod
    def backward(ctx, g):
        rows, n = ctx.rows, len(ctx.rows)
        got = _gather(g.contiguous(), [r.numel() for r in rows], ctx.group)
        full = g.new_zeros((ctx.n,) + tuple(g.shape[1:]))
        full.index_add_(0, torch.cat(rows), got)
        return full / n, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv),
                           input_split_sizes=list(send), group=group)
    return out


def mp_split(x: torch.Tensor, rows: list[torch.Tensor], me: int, group) -> torch.Tensor:
    """MP-Split: rows ``rows[me]`` of ``x`` (replicated over the MP ``group``; ``rows[m]`` are
    MP rank m's rows, known to every rank). Backward: AllGather of the parts' gradients, put
    back in place and averaged over the group (module docstring)."""
    return _MPSplit.apply(x, list(rows), me, group)


def mp_all_gather(x: torch.Tensor, sizes: list[int], me: int, group) -> torch.Tensor:
    """MP-AllGather of rows (``sizes[m]`` from MP rank m). Backward: ReduceScatter (sum)."""
    return _AllGather.apply(x, list(sizes), me, group)


def mp_gather_replicated(x: torch.Tensor, sizes: list[int], me: int, group) -> torch.Tensor:
    """MP-AllGather of rows whose output stays replicated over the MP group, as DeepSpeed-MoE's
    ``gather_tokens`` (backward: this rank's block of the gradient, no collective). The
    output gradient is the same on every MP rank (the group's tensor-parallel invariant) and
    each MP rank's loss counts, so the block is scaled by ``N_MP``: the ReduceScatter (sum) of
    the MP ranks' equal gradients, without the collective (as :class:`EspReduce` does for
    replicated ESP rows)."""
    return _MPGatherReplicated.apply(x, list(sizes), me, group)


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """One all-to-all of rows over ``group`` (``send[j]`` rows to rank j, ``recv[j]`` from it).
    Backward: the all-to-all back (the splits swapped)."""
    return _AllToAll.apply(x, list(send), list(recv), group)
