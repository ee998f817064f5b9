"""The exchange + experts block of the MoE layer as 7r scheduled tasks, forward and backward.

The send buffer (expert-major rows) is cut into r chunks: each expert's block of ``c_e`` rows
contributes rows ``[floor(i c_e / r), floor((i+1) c_e / r))`` to chunk i, so every chunk is a
valid all-to-all of its own and every expert sees a slice of its tokens (ScheMoE section 4,
"the input tensor is uniformly partitioned"). Forward runs C1 A1 D1 E C2 A2 D2 per chunk;
backward runs the mirrored tasks: the output gradient is compressed, sent to the experts,
decompressed, pushed through the experts' saved graph, compressed, sent back and decompressed.
Experts are row-wise, so any r and any scheduler give the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.comm.alltoall.base import AllToAll
from moeflow.comm.codecs.base import Codec
from moeflow.dispatch.permute import group_by_expert, ungroup
from moeflow.dispatch.plan import DispatchPlan
from moeflow.schedule.executor import CommLane, Stage, Timeline, run_schedule
from moeflow.schedule.schedulers import Scheduler


def chunk_bounds(counts: torch.Tensor, r: int) -> list[torch.Tensor]:
    """Per chunk, the rows each block contributes: ``floor((i+1)c/r) - floor(i c/r)``."""
    edges = [torch.div(counts * i, r, rounding_mode="floor") for i in range(r + 1)]
    return [edges[i + 1] - edges[i] for i in range(r)]


def chunk_rows(counts: torch.Tensor, r: int) -> list[torch.Tensor]:
    """Row indices (into the expert-major buffer) of each chunk."""
    starts = torch.cumsum(counts, 0) - counts
    out = []
    for i, n in enumerate(chunk_bounds(counts, r)):
        first = starts + torch.div(counts * i, r, rounding_mode="floor")
        block_start = torch.repeat_interleave(first - (torch.cumsum(n, 0) - n), n)
        out.append(block_start + torch.arange(int(n.sum())))
    return out


@dataclass
class ChunkPlan:
    rows: list[torch.Tensor] | None      # send-buffer rows of chunk i (None at r = 1: all)
    send_splits: list[list[int]]
    recv_splits: list[list[int]]
    recv_counts: list[torch.Tensor]      # (ep, E_local) per chunk

    @classmethod
    def build(cls, plan: DispatchPlan, r: int, device: torch.device) -> "ChunkPlan":
        ep, e_local = plan.recv_counts.shape
        recv = chunk_bounds(plan.recv_counts.reshape(-1), r)
        send = chunk_bounds(plan.send_counts, r)
        rows = None if r == 1 else [x.to(device) for x in chunk_rows(plan.send_counts, r)]
        return cls(rows=rows,
                   send_splits=[s.view(ep, e_local).sum(1).tolist() for s in send],
                   recv_splits=[c.view(ep, e_local).sum(1).tolist() for c in recv],
                   recv_counts=[c.view(ep, e_local) for c in recv])


class ScheduledExperts:
    """Runs one layer's exchange + experts with a scheduler; keeps what backward needs."""

    def __init__(self, experts: torch.nn.Module, algo: AllToAll, codec: Codec,
                 backward_codec: Codec, scheduler: Scheduler, r: int, lane: CommLane,
                 timeline: Timeline | None):
        self.experts, self.algo, self.codec = experts, algo, codec
        self.backward_codec, self.scheduler, self.r = backward_codec, scheduler, r
        self.lane, self.timeline = lane, timeline

    def _exchange(self, payloads, send, recv, combine=False):
        out = [self.algo.exchange(p, send, recv, combine) for p in payloads]
        return out, sum(p.numel() * p.element_size() for p in payloads)

    def _run(self, source: torch.Tensor, cp: ChunkPlan, codec: Codec, expert, phase: str
             ) -> torch.Tensor:
        """Run the 7r tasks over the rows of ``source`` (the send buffer in forward, the
        gradient of the returned rows in backward); ``expert(i, rows)`` is task E."""
        dtype, width = source.dtype, source.shape[1]

        def rows(i: int) -> torch.Tensor:
            return source if self.r == 1 else source.index_select(0, cp.rows[i])

        stage = Stage({
            "C1": lambda i, _: (lambda x: (codec.encode(x), x.numel()))(rows(i)),
            "A1": lambda i, p: self._exchange(p, cp.send_splits[i], cp.recv_splits[i]),
            "D1": lambda i, p: (codec.decode(p, dtype), p[0].shape[0] * width),
            "E": expert,
            "C2": lambda i, y: (codec.encode(y), y.numel()),
            "A2": lambda i, p: self._exchange(p, cp.recv_splits[i], cp.send_splits[i], True),
            "D2": lambda i, p: (codec.decode(p, dtype), p[0].shape[0] * width),
        })
        chunks = run_schedule(stage, self.r, self.scheduler, self.lane, self.timeline, phase)
        return _assemble(chunks, cp, source)

    def forward(self, send: torch.Tensor, cp: ChunkPlan) -> tuple[torch.Tensor, list]:
        saved: list = [None] * self.r

        def expert(i, x):
            with torch.enable_grad():
                inp = x.detach().requires_grad_()
                grouped, counts, perm = group_by_expert(inp, cp.recv_counts[i])
                out = ungroup(self.experts(grouped, counts), perm)
            saved[i] = (inp, out)
            return out.detach(), inp.numel()

        return self._run(send, cp, self.codec, expert, "forward"), saved

    def backward(self, grad: torch.Tensor, cp: ChunkPlan, saved: list,
                 params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, list]:
        param_grads: list = [None] * len(params)

        def expert(i, g):
            inp, out = saved[i]
            got = torch.autograd.grad(out, [inp] + params, g, allow_unused=True)
            for j, pg in enumerate(got[1:]):
                if pg is not None:
                    param_grads[j] = pg if param_grads[j] is None else param_grads[j] + pg
            saved[i] = None
            return got[0], g.numel()

        return self._run(grad, cp, self.backward_codec, expert, "backward"), param_grads


def _assemble(chunks: list[torch.Tensor], cp: ChunkPlan, like: torch.Tensor) -> torch.Tensor:
    if len(chunks) == 1:
        return chunks[0]
    out = like.new_empty((like.shape[0],) + tuple(chunks[0].shape[1:]))
    return out.index_copy_(0, torch.cat(cp.rows), torch.cat(chunks))


class _Scheduled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send, runner, cp, *params):
        back, saved = runner.forward(send, cp)
        ctx.runner, ctx.cp, ctx.saved, ctx.params = runner, cp, saved, params
        return back

    @staticmethod
    def backward(ctx, grad):
        grad_send, param_grads = ctx.runner.backward(grad.contiguous(), ctx.cp, ctx.saved,
                                                     list(ctx.params))
        return (grad_send, None, None, *param_grads)


def scheduled_experts(send: torch.Tensor, plan: DispatchPlan,
                      runner: ScheduledExperts) -> torch.Tensor:
    """Differentiable: the send buffer -> rows returned from the experts (same order)."""
    cp = ChunkPlan.build(plan, runner.r, send.device)
    return _Scheduled.apply(send, runner, cp, *runner.experts.parameters())
