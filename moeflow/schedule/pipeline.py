"""The exchange + experts block of the MoE layer as 7r scheduled tasks, forward and backward.

The send buffer (expert-major rows) is cut into r chunks (:mod:`.chunks`; ScheMoE section 4).
Forward runs C1 A1 D1 E C2 A2 D2 per chunk; backward runs the mirrored tasks: the output
gradient is compressed, sent to the experts, decompressed, pushed through the experts' saved
graph, compressed, sent back and decompressed. Experts are row-wise, so any r and any scheduler
give the same function; a chunk may be empty (r larger than a rank's rows is legal).

* A codec's payloads travel in one collective: several payloads (int8's values, scales and
  offsets) are packed into one byte buffer in C and unpacked in D.
* Decompression restores the dtype the payload had before compression, so under autocast the
  experts' output dtype reaches ``combine`` whatever the codec (a dense FFN's dtype).
* Codecs that cannot represent inf/NaN (``Codec.represents_nonfinite``) carry them through as
  they encode them; the count of such values is reported in the layer's ``stats``
  (``nonfinite_payload``) instead of raising on one rank while the others wait.
* Without autograd (eval, ``torch.no_grad``) the experts run without building a graph.
* Shared experts (``ScheduledExperts.shared``) run as the side task ``S`` on this rank's
  tokens: in forward on the layer input, in backward on the gradient of their output, each
  time while the first all-to-all of the pass is in flight (:mod:`.executor`).

Recomputation. By default the forward keeps each chunk's expert graph (its hidden
activations) for the backward's nested ``torch.autograd.grad``. It keeps only the experts'
input rows (the exchanged tokens) instead, saved through ``ctx.save_for_backward``, and
recomputes each chunk's experts inside backward task E right before differentiating them,
when either

* ``recompute`` is set (``MoEConfig.recompute="moe_act"``, Megatron-core's ``moe_act``
  recompute: the exchanged tokens stay, the experts' activations are recomputed), or
* saved-tensor hooks are active in forward (``torch.utils.checkpoint`` without reentrance,
  ``save_on_cpu``): the hooks then see the expert inputs like any saved tensor. A nested graph
  built under a non-reentrant checkpoint would make every nested ``autograd.grad`` of the
  backward (one per chunk and one for the shared experts) a graph task of its own that
  recomputes the whole checkpointed region again (3 forwards at r = 1, 6 at r = 4); with the
  inputs saved, the region is recomputed once, by the layer's own backward node.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch._C._autograd import _top_saved_tensors_default_hooks

from moeflow.comm.alltoall.base import AllToAll
from moeflow.comm.codecs.base import Codec
from moeflow.dispatch.plan import DispatchPlan, exchange_counts
from moeflow.schedule.chunks import ChunkPlan
from moeflow.schedule.executor import CommLane, Stage, Timeline, run_schedule
from moeflow.schedule.schedulers import Scheduler


def pack(payloads: list[torch.Tensor]) -> tuple[torch.Tensor, list | None]:
    """A codec's payloads (same rows) -> one tensor for one collective, and its layout."""
    if len(payloads) == 1:
        return payloads[0], None
    # explicit widths: a chunk may have no rows, where reshape(0, -1) is ambiguous; an empty
    # payload is rebuilt with standard strides (a codec's may carry strides a byte view
    # refuses, e.g. int8's (0, 1) scales), which for no elements is the same tensor
    parts = [(p if p.numel() else p.new_empty(p.shape))
             .reshape(p.shape[0], math.prod(p.shape[1:])).contiguous().view(torch.uint8)
             for p in payloads]
    layout = [(p.dtype, tuple(p.shape[1:]), part.shape[1]) for p, part in zip(payloads, parts)]
    return torch.cat(parts, 1), layout


def unpack(buf: torch.Tensor, layout: list | None) -> list[torch.Tensor]:
    if layout is None:
        return [buf]
    out, off = [], 0
    for dtype, tail, nbytes in layout:
        # a copy, always: a one-row slice counts as contiguous but keeps the buffer's row
        # stride, which a view as a wider dtype refuses
        part = buf.new_empty((buf.shape[0], nbytes)).copy_(buf.narrow(1, off, nbytes))
        part = part.view(dtype)
        out.append(part.reshape((buf.shape[0],) + tail))
        off += nbytes
    return out


class ScheduledExperts:
    """Runs one layer's exchange + experts with a scheduler; keeps what backward needs."""

    def __init__(self, experts: torch.nn.Module, algo: AllToAll, codec: Codec,
                 backward_codec: Codec, scheduler: Scheduler, r: int, lane: CommLane,
                 timeline: Timeline | None, nonfinite: torch.Tensor | None = None,
                 shared: torch.nn.Module | None = None,
                 inter_node_bytes: torch.Tensor | None = None, recompute: bool = False,
                 can_recompute: bool = True):
        self.experts, self.algo, self.codec = experts, algo, codec
        # 0-dim host counter, in place: bytes this rank put on inter-node links (forward and
        # backward exchanges of the payloads; None: not counted)
        self.inter_node_bytes = inter_node_bytes
        self.shared = shared             # shared experts (task S), or None
        self.backward_codec, self.scheduler, self.r = backward_codec, scheduler, r
        self.lane, self.timeline = lane, timeline
        self.nonfinite = nonfinite       # 0-dim counter, in place; None: not counted
        self.recompute = recompute       # keep the experts' inputs, not their graphs
        self.can_recompute = can_recompute   # False: the experts exist during forward only

    def saves_inputs(self) -> bool:
        """Whether this forward keeps the experts' input rows and recomputes them in backward
        (module docstring, "Recomputation"): asked, or saved-tensor hooks are active."""
        return self.can_recompute and (self.recompute
                                       or _top_saved_tensors_default_hooks(False) is not None)

    def _encode(self, codec: Codec, x: torch.Tensor):
        if self.nonfinite is not None and not codec.represents_nonfinite:
            self.nonfinite.add_(torch.isfinite(x).logical_not().sum())
        buf, layout = pack(codec.encode(x))
        return (buf, layout, x.dtype), x.numel()

    def _exchange(self, packed, cp: ChunkPlan, i: int, combine: bool):
        buf, layout, dtype = packed
        send, recv = ((cp.recv_splits[i], cp.send_splits[i]) if combine
                      else (cp.send_splits[i], cp.recv_splits[i]))
        matrix = cp.transposed(i) if combine else cp.matrix[i]
        got = self.algo.exchange(buf, send, recv, combine, matrix=matrix)
        if self.inter_node_bytes is not None and buf.shape[0]:
            row = buf.element_size() * (buf.numel() // buf.shape[0])
            self.inter_node_bytes.add_(self.algo.inter_node_rows(send, matrix, combine) * row)
        return (got, layout, dtype), buf.numel() * buf.element_size()

    @staticmethod
    def _decode(codec: Codec, packed, width: int):
        buf, layout, dtype = packed
        return codec.decode(unpack(buf, layout), dtype), buf.shape[0] * width

    def _run(self, source: torch.Tensor, cp: ChunkPlan, codec: Codec, expert, phase: str,
             side=None) -> torch.Tensor:
        """Run the 7r tasks over the rows of ``source`` (the send buffer in forward, the
        gradient of the returned rows in backward); ``expert(i, rows)`` is task E."""
        width = source.shape[1]

        def rows(i: int) -> torch.Tensor:
            return source if self.r == 1 else source.index_select(0, cp.rows[i])

        def unless_none(fn):
            # backward without an input gradient: E returns None and the way back is skipped
            return lambda i, v: (None, 0) if v is None else fn(i, v)

        stage = Stage({
            "C1": lambda i, _: self._encode(codec, rows(i)),
            "A1": lambda i, p: self._exchange(p, cp, i, False),
            "D1": lambda i, p: self._decode(codec, p, width),
            "E": expert,
            "C2": unless_none(lambda i, y: self._encode(codec, y)),
            "A2": unless_none(lambda i, p: self._exchange(p, cp, i, True)),
            "D2": unless_none(lambda i, p: self._decode(codec, p, width)),
        })
        chunks = run_schedule(stage, self.r, self.scheduler, self.lane, self.timeline, phase,
                              source.device, side)
        if any(c is None for c in chunks):
            return None
        return _assemble(chunks, cp, source)

    def forward(self, send: torch.Tensor, cp: ChunkPlan, keep_graph: bool | str = True,
                shared_in: torch.Tensor | None = None) -> tuple[torch.Tensor, list, dict]:
        """The returned rows, the experts' saved graphs, and ``{"y": shared experts' output,
        "saved": their graph}`` (empty without shared experts). ``keep_graph="inputs"``:
        ``saved`` holds each chunk's detached input rows instead of its graph, and
        ``"saved"`` the shared experts' input (recomputed in :meth:`backward`)."""
        saved: list = [None] * self.r
        side_out: dict = {}
        inputs_only = keep_graph == "inputs"

        def expert(i, x):
            g = cp.groupings[i]
            if not keep_graph or inputs_only:
                with torch.no_grad():
                    y = g.ungroup(self.experts(g.group(x), g.counts, g.offsets))
                if inputs_only:
                    saved[i] = x.detach()
                return y, x.numel()
            with torch.enable_grad():
                inp = x.detach().requires_grad_()
                out = g.ungroup(self.experts(g.group(inp), g.counts, g.offsets))
            saved[i] = (inp, out)
            return out.detach(), inp.numel()

        def side(_i, _arg):                       # task S, forward
            if not keep_graph or inputs_only:
                with torch.no_grad():
                    side_out["y"] = self.shared(shared_in)
                if inputs_only:
                    side_out["saved"] = shared_in.detach()
            else:
                with torch.enable_grad():
                    inp = shared_in.detach().requires_grad_()
                    out = self.shared(inp)
                side_out["saved"] = (inp, out)
                side_out["y"] = out.detach()
            return None, shared_in.numel()

        back = self._run(send, cp, self.codec, expert, "forward",
                         side if shared_in is not None else None)
        return back, saved, side_out

    def backward(self, grad: torch.Tensor, cp: ChunkPlan, saved: list,
                 params: list[torch.nn.Parameter], shared_grad: torch.Tensor | None = None,
                 side_saved: dict | None = None, shared_params: list | None = None,
                 input_grad: bool = True, autocast: tuple | None = None,
                 ) -> tuple[torch.Tensor | None, list, tuple]:
        """Gradients of the send buffer and the experts' parameters, and ``(input gradient,
        parameter gradients)`` of the shared experts (``()`` without them).

        ``input_grad=False`` (the send buffer needs no gradient, e.g. the layer's input is
        a leaf without grad): the experts compute parameter gradients only, and the way back
        (C2, A2, D2) carries nothing, as autograd would skip it (Tutel's backward does). The
        flag must be the same on every rank (it is whenever the model is).

        ``autocast``: the forward's :func:`autocast_state`; the experts recomputed from their
        input rows run under it, so that under autocast they compute in the forward's dtype
        (autograd's backward runs outside the caller's autocast region)."""
        param_grads: list = [None] * len(params)
        side_grads: list = []
        first = 0 if input_grad else 1
        # Parm's ESP with replicated rows: the shards' partial input gradients are summed over
        # the ESP group (Megatron's f), a collective of this task, so issued on the lane
        fix = getattr(self.experts, "reduce_input_grad", None)
        # FSSDP's held experts are unbound after the forward: the recomputation binds this
        # call's weights (saved through ctx.save_for_backward, so a checkpoint hands back its
        # recomputed ones) to a copy, and differentiates with respect to them
        experts, rebound = self.experts, params
        if hasattr(self.experts, "bound_to"):
            rebound = [p.detach().requires_grad_() for p in params]
            experts = self.experts.bound_to(rebound)

        def expert(i, g):
            if isinstance(saved[i], torch.Tensor):      # the input rows: recompute the experts
                gr = cp.groupings[i]
                with torch.enable_grad(), _autocast(autocast):
                    inp = saved[i].detach().requires_grad_()
                    out = gr.ungroup(experts(gr.group(inp), gr.counts, gr.offsets))
                wrt = rebound
            else:
                (inp, out), wrt = saved[i], params
            got = _grad(out, ([inp] + wrt)[first:], g)
            for j, pg in enumerate(got[1 - first:]):
                if pg is not None:
                    param_grads[j] = pg if param_grads[j] is None else param_grads[j] + pg
            saved[i] = None
            if not input_grad:
                return None, g.numel()
            if fix is None:
                return got[0], g.numel()
            return fix(torch.zeros_like(inp) if got[0] is None else got[0]), g.numel()

        def side(_i, _arg):                       # task S, backward
            got = side_saved.pop("saved")
            if isinstance(got, torch.Tensor):             # the input: recompute them
                with torch.enable_grad(), _autocast(autocast):
                    inp = got.detach().requires_grad_()
                    out = self.shared(inp)
            else:
                inp, out = got
            side_grads.extend(_grad(out, [inp] + shared_params, shared_grad))
            return None, shared_grad.numel()

        back = self._run(grad, cp, self.backward_codec, expert, "backward",
                         side if shared_grad is not None else None)
        return back, param_grads, tuple(side_grads)


def _assemble(chunks: list[torch.Tensor], cp: ChunkPlan, like: torch.Tensor) -> torch.Tensor:
    """The chunks' returned rows back in send-buffer order: one row gather by the inverse of
    the chunks' row order (``cp.assemble``; a gather, not an ``index_copy`` scatter)."""
    if len(chunks) == 1:
        return chunks[0]
    return torch.cat(chunks).index_select(0, cp.assemble)


def autocast_state(device: torch.device) -> tuple:
    """``(device type, enabled, dtype)`` of the running autocast, which a recomputation
    re-enters (``torch.utils.checkpoint`` keeps the same state for its reruns)."""
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def _autocast(state: tuple | None):
    if state is None:
        return contextlib.nullcontext()
    kind, enabled, dtype = state
    return torch.autocast(kind, dtype=dtype, enabled=enabled)


def _keeps_weights(runner, inputs_only: bool) -> bool:
    """Whether the experts' weights travel as saved tensors (FSSDP's held copy, recomputed
    from its inputs: a checkpoint then frees the first forward's held experts and hands the
    recomputation's back), not as ``ctx`` attributes."""
    return inputs_only and hasattr(runner.experts, "bound_to")


class _Scheduled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send, runner, cp, *params):
        inputs_only = runner.saves_inputs()
        back, saved, _ = runner.forward(send, cp, "inputs" if inputs_only else True)
        ctx.runner, ctx.cp, ctx.params = runner, cp, params
        ctx.autocast = autocast_state(send.device)
        ctx.inputs_only, ctx.saved = inputs_only, (None if inputs_only else saved)
        ctx.keeps_weights = _keeps_weights(runner, inputs_only)
        if ctx.keeps_weights:
            ctx.save_for_backward(*saved, *params)
            ctx.params, ctx.r = None, len(saved)
        elif inputs_only:
            ctx.save_for_backward(*saved)
        return back

    @staticmethod
    def backward(ctx, grad):
        params = ctx.params
        if ctx.keeps_weights:
            tensors = ctx.saved_tensors
            saved, params = list(tensors[:ctx.r]), tensors[ctx.r:]
        else:
            saved = list(ctx.saved_tensors) if ctx.inputs_only else ctx.saved
        grad_send, param_grads, _ = ctx.runner.backward(
            grad.contiguous(), ctx.cp, saved, list(params),
            input_grad=ctx.needs_input_grad[0], autocast=ctx.autocast)
        return (grad_send, None, None, *param_grads)


class _ScheduledShared(torch.autograd.Function):
    """:class:`_Scheduled` with the shared experts as task S: inputs ``(send, shared_in)``,
    outputs ``(returned rows, shared experts' output)``."""

    @staticmethod
    def forward(ctx, send, shared_in, runner, cp, n_expert_params, *params):
        inputs_only = runner.saves_inputs()
        back, saved, side = runner.forward(send, cp, "inputs" if inputs_only else True,
                                           shared_in=shared_in)
        ctx.runner, ctx.cp, ctx.params, ctx.n = runner, cp, params, n_expert_params
        ctx.autocast = autocast_state(send.device)
        ctx.inputs_only, ctx.r = inputs_only, len(saved)
        ctx.keeps_weights = _keeps_weights(runner, inputs_only)
        if inputs_only:                 # the chunks' input rows, then the shared experts'
            weights = params[:n_expert_params] if ctx.keeps_weights else ()
            ctx.save_for_backward(*saved, side["saved"], *weights)
            ctx.saved, ctx.side = None, None
            if ctx.keeps_weights:
                ctx.params = (None,) * n_expert_params + tuple(params[n_expert_params:])
        else:
            ctx.saved, ctx.side = saved, side
        return back, side["y"]

    @staticmethod
    def backward(ctx, grad, shared_grad):
        n, params = ctx.n, ctx.params
        if ctx.inputs_only:
            tensors = ctx.saved_tensors
            saved, shared_in = list(tensors[:ctx.r]), tensors[ctx.r]
            side_saved = {"saved": shared_in}
            if ctx.keeps_weights:
                params = tuple(tensors[ctx.r + 1:]) + tuple(params[n:])
        else:
            saved, side_saved = ctx.saved, ctx.side
        grad_send, param_grads, side = ctx.runner.backward(
            grad.contiguous(), ctx.cp, saved, list(params[:n]),
            shared_grad.contiguous(), side_saved, list(params[n:]),
            input_grad=ctx.needs_input_grad[0], autocast=ctx.autocast)
        return (grad_send, side[0], None, None, None, *param_grads, *side[1:])


@torch.compiler.disable
def scheduled_experts(send: torch.Tensor, plan: DispatchPlan,
                      runner: ScheduledExperts, shared_in: torch.Tensor | None = None):
    """Differentiable: the send buffer -> rows returned from the experts (same order); with
    ``shared_in`` (the layer's tokens on this rank) and ``runner.shared``, also the shared
    experts' output on them, computed as task S while the all-to-all is in flight:
    ``(rows, shared_out)``.

    Collective: learns the count matrix first. This is where ``torch.compile`` breaks the
    graph (once per MoE layer): everything before (routing, plan, permute) and after (combine,
    projections) compiles; inside, host bookkeeping, collectives and the scheduled tasks run
    eagerly (the expert math is one batched or grouped GEMM per weight already).
    """
    if plan.counts is None:
        exchange_counts(plan, runner.algo.topo)
    cp = ChunkPlan.build(plan, runner.r, send.device)
    params = list(runner.experts.parameters())
    if shared_in is None:
        if torch.is_grad_enabled() and (send.requires_grad
                                        or any(p.requires_grad for p in params)):
            return _Scheduled.apply(send, runner, cp, *params)
        return runner.forward(send, cp, keep_graph=False)[0]
    shared_params = list(runner.shared.parameters())
    if torch.is_grad_enabled() and (send.requires_grad or shared_in.requires_grad or any(
            p.requires_grad for p in params + shared_params)):
        return _ScheduledShared.apply(send, shared_in, runner, cp, len(params), *params,
                                      *shared_params)
    back, _, side = runner.forward(send, cp, keep_graph=False, shared_in=shared_in)
    return back, side["y"]


def _grad(out: torch.Tensor, wrt: list, grad: torch.Tensor) -> list:
    """``torch.autograd.grad(out, wrt, grad)`` for the tensors of ``wrt`` that require a
    gradient (frozen experts, ``requires_grad_(False)``, have none: None in their place, as
    autograd leaves a frozen parameter's ``.grad`` alone)."""
    need = [k for k, t in enumerate(wrt) if t.requires_grad]
    got: list = [None] * len(wrt)
    if need and out.requires_grad:
        for k, v in zip(need, torch.autograd.grad(out, [wrt[k] for k in need], grad,
                                                  allow_unused=True)):
            got[k] = v
    return got
