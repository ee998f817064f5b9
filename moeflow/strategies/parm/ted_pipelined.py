"""The ``ted`` schedule's node-once exchange cut into ``r`` chunks, pipelined (beyond the Parm
paper): ScheMoE's pipelining (Section 3.2 / 4: chunk the all-to-all so that one chunk's
computation overlaps another chunk's communication) applied to DeepSpeed-TED's order, and
Parm's SAA idea (Section III-D: run the intra-node collective at once with the inter-node one)
applied to its ESP collectives.

Every rank cuts its rows of each expert (after the MP drop, :func:`.ted.ted_experts`) into
``r`` consecutive parts (:func:`moeflow.schedule.chunks.chunk_counts`, as ScheMoE's chunks);
chunk ``c`` holds part ``c`` of every expert's rows, so it is a whole exchange of its own
(:func:`.ted.node_once_experts` with the counts ``C_c``). With ``overlap=True`` (the
``pipelined`` scheduler) the forward issues, on every rank::

    EP group : out_0, out_1, back_0, out_2, back_1, ..., out_{r-1}, back_{r-2}, back_{r-1}
    ESP group: ag_0, rs_0, ag_1, rs_1, ..., ag_{r-1}, rs_{r-1}

``out_c``: chunk c's EP-AlltoAll (the only transfer that crosses nodes with the ESP groups in a
node), ``ag_c`` / ``rs_c``: its ESP-AllGather and ESP-ReduceScatter around the shards,
``back_c``: its EP-AlltoAll back. ``out_{c+1}`` is issued asynchronously before chunk c's
AllGather, shards and ReduceScatter run, and ``back_c`` asynchronously after them, so chunk
c+1's inter-node transfer runs while chunk c's intra-node collectives and expert computation
do (two process groups: gloo runs collectives of different groups at once and those of one
group in issue order; NCCL has a stream per communicator). Each group sees its collectives in
the same order on all its ranks. The backward is the same pipeline on the gradients (adjoints:
``back_c`` -> the EP-AlltoAll out, ``rs_c`` -> ESP-AllGather, shards' backward, ``ag_c`` ->
ESP-ReduceScatter, ``out_c`` -> the EP-AlltoAll back), with the same interleave on the EP
group. With ``overlap=False`` (the ``sequential`` scheduler) the same chunks run one after the
other, every collective waited for at once.

Every asynchronous collective is waited for with the process group's timeout
(:func:`moeflow.comm.sparse.wait_work`); the row counts are host integers of the plan (no host
synchronisation added). The shards run inside this autograd function on detached chunk rows
(their graphs kept per chunk, their parameters inputs of the function), so the backward can
interleave their gradients with the pipeline's collectives.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeflow.comm.sparse import group_timeout, wait_work
from moeflow.schedule.chunks import (Grouping, block_rows, chunk_counts, inverse_permutation,
                                     to_device)
from moeflow.strategies.parm.collectives import _all_gather, _padded, _reduce_scatter
from moeflow.topology import Topology


class _Pending:
    """An asynchronous collective (or a local result) and how to read its output."""

    def __init__(self, work, finish, device, timeout):
        self.work, self.finish, self.device, self.timeout = work, finish, device, timeout

    def result(self) -> torch.Tensor:
        if self.work is not None:
            wait_work(self.work, self.timeout, self.device)
            self.work = None
        return self.finish()


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group, n: int) -> _Pending:
    if n == 1:
        return _Pending(None, lambda: x, x.device, None)
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv),
                                  input_split_sizes=list(send), group=group, async_op=True)
    return _Pending(work, lambda: out, x.device, group_timeout(group))


def _gather(x: torch.Tensor, sizes: list[int], group) -> _Pending:
    if len(sizes) == 1:
        return _Pending(None, lambda: x, x.device, None)
    top = max(sizes)
    buf = x.new_empty((len(sizes) * top,) + tuple(x.shape[1:]))
    work = _all_gather(buf, _padded(x, top), group=group, async_op=True)
    return _Pending(work, lambda: torch.cat([buf[i * top:i * top + n]
                                             for i, n in enumerate(sizes)]),
                    x.device, group_timeout(group))


def _scatter_sum(x: torch.Tensor, sizes: list[int], me: int, group) -> _Pending:
    if len(sizes) == 1:
        return _Pending(None, lambda: x, x.device, None)
    top = max(sizes)
    padded = torch.cat([_padded(b, top) for b in torch.split(x.contiguous(), sizes)])
    out = x.new_empty((top,) + tuple(x.shape[1:]))
    work = _reduce_scatter(out, padded, group=group, async_op=True)
    return _Pending(work, lambda: out[:sizes[me]], x.device, group_timeout(group))


class ChunkCounts:
    """Host counts of one chunk: ``send[j]`` / ``recv[j]`` rows to / from EP rank j, ``sizes[t]``
    rows ESP rank t received (the ESP-AllGather's blocks), and the regroup of the gathered rows
    for the shards (sources x local experts -> expert-major)."""

    def __init__(self, C: np.ndarray, topo: Topology, slot):
        ep, esp, i, s = topo.ep_size, topo.esp_size, topo.ep_rank, topo.esp_rank
        el, me = C.shape[1] // ep, topo.expert_slot
        mine = slice(i * el, (i + 1) * el)
        self.send = [int(C[me, j * el:(j + 1) * el].sum()) for j in range(ep)]
        self.recv = [int(C[slot(j, s), mine].sum()) for j in range(ep)]
        self.sizes = [int(sum(C[slot(j, t), mine].sum() for j in range(ep)))
                      for t in range(esp)]
        self.K = np.stack([C[slot(j, t), mine] for t in range(esp) for j in range(ep)])


def chunk_plan(C: np.ndarray, r: int, topo: Topology, slot) -> tuple[list[ChunkCounts],
                                                                     list[np.ndarray], np.ndarray]:
    """``(chunks, rows, assemble)``: each chunk's counts, the rows of this rank's piece
    (expert-major, ``C[me][e]`` rows of expert e) it holds, and the permutation that puts the
    chunks' concatenated outputs back in piece order."""
    parts = chunk_counts(C, r)
    mine = C[topo.expert_slot]
    starts = np.cumsum(mine) - mine
    rows = [block_rows(starts + (mine * c) // r, parts[c][topo.expert_slot]) for c in range(r)]
    return ([ChunkCounts(p, topo, slot) for p in parts], rows,
            inverse_permutation(np.concatenate(rows)))


class _PipelinedExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece, job, *params):
        topo, chunks, rows, assemble, experts, overlap, need_grad = job
        ep, s = topo.ep_size, topo.esp_rank
        dev = piece.device
        xs = [piece.index_select(0, to_device(r_, dev)) for r_ in rows]
        graphs, outs = [], []
        r = len(chunks)
        pending = _a2a(xs[0], chunks[0].send, chunks[0].recv, topo.ep_group, ep)
        for c, ch in enumerate(chunks):
            got = pending.result()
            if c + 1 < r:       # chunk c+1's EP-AlltoAll runs under chunk c's ESP work
                nxt = chunks[c + 1]
                pending = _a2a(xs[c + 1], nxt.send, nxt.recv, topo.ep_group, ep)
                if not overlap:
                    pending.result()
            gathered = _gather(got, ch.sizes, topo.esp_group).result()
            leaf = gathered.detach().requires_grad_(need_grad)
            g = Grouping.build(ch.K, dev)
            with torch.set_grad_enabled(need_grad):
                y = g.ungroup(experts(g.group(leaf), g.counts, g.offsets))
            graphs.append((leaf, y))
            back = _scatter_sum(y.detach(), ch.sizes, s, topo.esp_group).result()
            outs.append(_a2a(back, ch.recv, ch.send, topo.ep_group, ep))
            if not overlap:
                outs[-1].result()
        ctx.job, ctx.graphs, ctx.params = job, graphs, params
        ctx.n = piece.shape[0]
        done = torch.cat([o.result() for o in outs])
        return done.index_select(0, to_device(assemble, dev))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        topo, chunks, rows, assemble, experts, overlap, _ = ctx.job
        ep, s = topo.ep_size, topo.esp_rank
        dev, params = grad.device, ctx.params
        gs = [grad.index_select(0, to_device(r_, dev)) for r_ in rows]
        r = len(chunks)
        pgrads: list[torch.Tensor | None] = [None] * len(params)
        outs = []
        # the adjoint of back_c: the EP-AlltoAll out (chunk c's rows' gradients to the shards)
        pending = _a2a(gs[0], chunks[0].send, chunks[0].recv, topo.ep_group, ep)
        for c, ch in enumerate(chunks):
            got = pending.result()
            if c + 1 < r:
                nxt = chunks[c + 1]
                pending = _a2a(gs[c + 1], nxt.send, nxt.recv, topo.ep_group, ep)
                if not overlap:
                    pending.result()
            gy = _gather(got, ch.sizes, topo.esp_group).result()   # rs_c's adjoint
            leaf, y = ctx.graphs[c]
            got_grads = torch.autograd.grad(y, (leaf,) + tuple(params), gy, allow_unused=True)
            for k, pg in enumerate(got_grads[1:]):
                if pg is not None:
                    pgrads[k] = pg if pgrads[k] is None else pgrads[k] + pg
            gx = _scatter_sum(got_grads[0], ch.sizes, s, topo.esp_group).result()  # ag_c's
            outs.append(_a2a(gx, ch.recv, ch.send, topo.ep_group, ep))    # out_c's adjoint
            if not overlap:
                outs[-1].result()
        ctx.graphs = None
        done = torch.cat([o.result() for o in outs])
        gpiece = done.index_select(0, to_device(assemble, dev))
        return (gpiece, None) + tuple(pgrads)


def pipelined_node_once_experts(piece: torch.Tensor, C: np.ndarray, experts, topo: Topology,
                                r: int, overlap: bool, slot) -> torch.Tensor:
    """Differentiable: as :func:`.ted.node_once_experts` (this rank's rows, expert-major ->
    their outputs), in ``r`` chunks, pipelined when ``overlap`` (module docstring).
    ``experts``: the shards (``experts(x, counts, offsets)``, partial outputs; an
    ``nn.Module`` whose parameters get their gradients through this function)."""
    chunks, rows, assemble = chunk_plan(C, r, topo, slot)
    params = tuple(p for p in experts.parameters() if p.requires_grad)
    job = (topo, chunks, rows, assemble, experts, overlap, torch.is_grad_enabled())
    return _PipelinedExchange.apply(piece, job, *params)


#: the chunk counts ``parallel_schedule="auto"`` weighs the pipelined ted at (Algorithm 1's
#: further candidates, beyond the paper: :func:`.algorithm1.ted_pipelined_time`)
AUTO_TED_CHUNKS = (2, 4)
_PREFIX = "ted-r"


def pipelined_name(chunks: int) -> str:
    """The schedule name of the ted schedule in ``chunks`` pipelined chunks, as Algorithm 1
    and the benches report it: ``"ted-r4"``."""
    return f"{_PREFIX}{chunks}"


def pipelined_chunks(schedule: str) -> int | None:
    """The chunk count of a :func:`pipelined_name`, None for any other schedule."""
    if schedule.startswith(_PREFIX) and schedule[len(_PREFIX):].isdigit():
        return int(schedule[len(_PREFIX):])
    return None
