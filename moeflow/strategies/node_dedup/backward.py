"""The backward of the node-deduplicated exchange (``a2a="node_dedup"``), scheduled like its
forward: ScheMoE section 4's schedules (sequential, pipelined, OptSche, Eq. 12) applied to
the mirrored tasks, as plain expert parallelism's backward is
(:meth:`moeflow.schedule.pipeline.ScheduledExperts.backward`).

The whole exchange of one call is one autograd node. Its forward runs the seven tasks per
chunk (:mod:`moeflow.strategies.node_dedup.steps`) and keeps, per computing task (C1, D1, E,
C2, D2), that task's own graph from detached inputs to its outputs; the lane tasks (A1, A2)
build no graph and keep the few tensors their backward needs. Its backward runs, through the
same scheduler order and executor, the stage

  C1  <- D2's backward: the chunk's output gradient to its partial sums'   (computing lane)
  A1  <- A2's: the partial sums' gradients cross back (backward codec), the gated sums'
         backward and the fan-in's reverse inside the node, in the reverse of their forward
         order (per rank then per node: trimmed.py; at the relay: padded.py) (comm. lane)
  D1  <- C2's backward
  E   <- the experts' backward (input and parameter gradients)
  C2  <- D1's backward
  A2  <- A1's: the fan-out's reverse inside the node, the sum over a token's choices, the
         token and gate gradients cross back once per (token, node)       (communication lane)
  D2  <- C1's backward: the chunk's rows of the send buffer's gradient

so chunk i's hops run on the lane while the computing lane differentiates other chunks'
experts, every rank issuing its collectives in the scheduler's order (one lane, one order:
docs/design.md, "One collective order per rank"). The computing tasks differentiate their
kept graphs with ``torch.autograd.grad`` on the computing thread (reentrant, as
``ScheduledExperts``'s task E does); the lane tasks are explicit arithmetic
(:class:`~moeflow.strategies.node_dedup.steps.DedupStage`), since a backward issued from the
lane thread could not run CUDA autograd nodes while this node holds the device's autograd
thread. The collectives and their sizes are those autograd's mirror issued: no extra bytes,
no host read. The memory it costs beyond autograd's mirror: each computing task's outputs
stay referenced until its backward (``torch.autograd.grad`` starts from them), as
``ScheduledExperts``'s task E keeps its output; the relay's expert outputs and gates, which
the gated sum's backward needs, autograd kept too.

Where saved-tensor hooks are active in forward (``torch.utils.checkpoint`` without
reentrance, ``save_on_cpu``), ``r >= 2`` keeps this scheduled backward: the computing tasks
build their kept graphs under identity hooks (:func:`_plain_saves`), so their tensors stay on
the device (neither offloaded nor dropped for recomputation: the cost of the exchange's region
under those hooks) and no backward task unpacks, or recomputes, anything. Autograd's
step-by-step mirror is not safe there: the lane tasks would build autograd nodes on the lane
thread, and the backward would issue their collectives in an order set by two threads'
sequence numbers, which can differ per rank (e.g. with an empty chunk on one rank), against
docs/design.md's "One collective order per rank". ``r = 1`` (one chunk, its hops in program
order) keeps the step-by-step mirror under hooks. A reentrant checkpoint recomputes with grad
enabled and no hooks, so its backward is scheduled.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._C._autograd import _top_saved_tensors_default_hooks

from moeflow.schedule.executor import Stage, run_schedule
from moeflow.strategies.node_dedup.steps import DedupStage

COMPUTE_TASKS = ("C1", "D1", "E", "C2", "D2")


def _bounds(T: int, r: int) -> list[int]:
    return [(i * T) // r for i in range(r + 1)]      # the stages' chunks of tokens


@torch.compiler.disable
def scheduled_dedup(send: torch.Tensor, build: Callable[[torch.Tensor], DedupStage],
                    runner) -> torch.Tensor:
    """Differentiable: the send buffer (token, gates per row) -> each token's combined
    expert output. ``build(send)`` makes the call's :class:`DedupStage` (collective: its
    count exchange). Like :func:`moeflow.schedule.pipeline.scheduled_experts`, where
    ``torch.compile`` breaks the graph: the tasks run eagerly."""
    params = [p for p in runner.experts.parameters()]
    if (torch.is_grad_enabled() and schedules_backward(runner.r)
            and (send.requires_grad or any(p.requires_grad for p in params))):
        return _ScheduledDedup.apply(send, build, runner, *params)
    stage = build(send)             # no grad, or step by step (r = 1 under saved-tensor hooks)
    chunks = run_schedule(stage.forward, runner.r, runner.scheduler, runner.lane,
                          runner.timeline, "forward", send.device)
    return chunks[0] if runner.r == 1 else torch.cat(chunks)


def schedules_backward(r: int) -> bool:
    """Whether the exchange's backward is scheduled (module docstring): always without
    saved-tensor hooks, and for ``r >= 2`` under them."""
    return r >= 2 or _top_saved_tensors_default_hooks(False) is None


def _plain_saves():
    """Identity saved-tensor hooks: the graphs built inside save their tensors as they are,
    whatever hooks (checkpoint, ``save_on_cpu``) the caller has active."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_() if t.is_floating_point() else t


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


class _ScheduledDedup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send, build, runner, *params):
        stage = build(send)
        r, bounds = runner.r, _bounds(send.shape[0], runner.r)
        graphs: dict[tuple[str, int], tuple[list, list]] = {}

        def kept(kind: str, fn):
            """A computing task that keeps its own graph, from detached inputs."""
            def run(i, arg):
                if kind == "C1":                    # the chunk's rows of the send buffer
                    arg = send[bounds[i]:bounds[i + 1]]
                ins = [_leaf(t) for t in _flat(arg)]
                with torch.enable_grad(), _plain_saves():
                    out, size = fn(i, ins[0] if len(ins) == 1 else tuple(ins))
                outs = _flat(out)
                graphs[(kind, i)] = ([t for t in ins if t.requires_grad], outs)
                det = tuple(t.detach() for t in outs)
                return (det if isinstance(out, tuple) else det[0]), size
            return run

        fns = dict(stage.forward.fns)
        fns.update({kind: kept(kind, fns[kind]) for kind in COMPUTE_TASKS})
        chunks = run_schedule(Stage(fns), r, runner.scheduler, runner.lane, runner.timeline,
                              "forward", send.device)
        ctx.stage, ctx.graphs, ctx.runner, ctx.params = stage, graphs, runner, params
        ctx.bounds = bounds
        return chunks[0] if r == 1 else torch.cat(chunks)

    @staticmethod
    def backward(ctx, grad):
        runner, graphs, stage, bounds = ctx.runner, ctx.graphs, ctx.stage, ctx.bounds
        params = ctx.params
        wants = [i for i, p in enumerate(params) if p.requires_grad]
        param_grads: list = [None] * len(params)
        input_grad = ctx.needs_input_grad[0]
        grad = grad.contiguous()
        gate_grads: dict[int, torch.Tensor] = {}     # A2's backward -> A1's, on the lane

        def differentiate(kind: str, i: int, gs, with_params: bool = False):
            """The gradients of task (kind, i)'s inputs (and of the expert parameters) from
            those of its outputs; inputs without one get zeros."""
            ins, outs = graphs.pop((kind, i))
            pairs = [(o, g) for o, g in zip(outs, gs) if g is not None and o.requires_grad]
            wrt = (ins if (input_grad or kind != "E") else []) + (
                [params[j] for j in wants] if with_params else [])
            got = (torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                       allow_unused=True) if pairs and wrt else [None] * len(wrt))
            n = len(wrt) - (len(wants) if with_params else 0)
            if with_params:
                for j, pg in zip(wants, got[n:]):
                    if pg is not None:
                        param_grads[j] = pg if param_grads[j] is None else param_grads[j] + pg
            return [torch.zeros_like(t) if g is None else g for t, g in zip(ins, got[:n])]

        def unless_none(fn):
            # no input gradient wanted: the way back after E carries nothing (as autograd
            # would skip it; the flag is the same on every rank)
            return lambda i, v: (None, 0) if v is None else fn(i, v)

        def d2_back(i, _):
            g = grad[bounds[i]:bounds[i + 1]]
            (g_back,) = differentiate("D2", i, [g])
            return g_back, g.numel()

        def a2_back(i, g_back):
            (g_out, g_gate), size = stage.a2_back(i, g_back)
            gate_grads[i] = g_gate
            return g_out, size

        def c2_back(i, g):
            (g_out,) = differentiate("C2", i, [g])
            return g_out, g.numel()

        def e_back(i, g):
            got = differentiate("E", i, [g], with_params=True)
            return (got[0] if input_grad else None), g.numel()

        def d1_back(i, g):
            (g_rows,) = differentiate("D1", i, [g])
            return g_rows, g.numel()

        def a1_back(i, g_rows):
            return stage.a1_back(i, g_rows, gate_grads.pop(i))

        def c1_back(i, g):
            (g_send,) = differentiate("C1", i, list(g))
            return g_send, g_send.numel()

        back = Stage({"C1": d2_back, "A1": a2_back, "D1": c2_back, "E": e_back,
                      "C2": unless_none(d1_back), "A2": unless_none(a1_back),
                      "D2": unless_none(c1_back)})
        chunks = run_schedule(back, runner.r, runner.scheduler, runner.lane, runner.timeline,
                              "backward", grad.device)
        ctx.graphs = ctx.stage = None
        g_send = None
        if input_grad:
            g_send = chunks[0] if runner.r == 1 else torch.cat(chunks)
        return (g_send, None, None, *param_grads)
