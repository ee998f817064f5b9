"""The steps of one chunk of the node-deduplicated exchange (``a2a="node_dedup"``), as the
seven tasks of a ScheMoE schedule (ScheMoE section 4, Eq. 4-12; the exchange itself is
DeepEP's inter-node dispatch / combine, :mod:`moeflow.strategies.node_dedup.strategy`).

The layer's tokens are cut into r chunks of consecutive tokens; each chunk is a whole
deduplicated exchange of its own (its (token, node) pairs, its fan-out, its partial sums), so
the schedulers' orders (sequential, pipelined, OptSche) apply unchanged:

  C1  the chunk's (token, node) pair rows: token, gates, expert ids       (computing lane)
  A1  inter-node hop (encoded), fan-out inside the node (raw)             (communication lane)
  D1  the received rows grouped by local expert                           (computing lane)
  E   the experts
  C2  their outputs in the order A2 gathers from
  A2  gated partial sums, back to the relay (raw), inter-node hop (encoded) (communication lane)
  D2  each token sums its nodes' partial sums

With split sizes from exchanged counts (:mod:`moeflow.strategies.node_dedup.trimmed`) the
fan-out sends one copy of a token per destination rank and the expert rank sums its own
choices before the way back (DeepEP's normal mode); padded
(:mod:`moeflow.strategies.node_dedup.padded`) it sends one row per choice into GShard's slots
and the relay sums.

Every step is differentiable. The backward is scheduled too
(:mod:`moeflow.strategies.node_dedup.backward`, ScheMoE section 4): the computing tasks keep
their own graphs, the lane tasks' backward is explicit (:class:`DedupStage`), and the mirrored
tasks run in the scheduler's order, the hops on the lane. (Under saved-tensor hooks autograd
records every step, on whichever lane ran it, and runs the mirror in its own order, the same
graph on every rank.) A codec
encodes what crosses between nodes: the node copy of a token in dispatch (one encoding per
(token, node), not per (token, expert)) and the node's partial sum in combine, straight
through (the backward encodes the gradients with the backward codec, as the scheduled
exchange of plain expert parallelism does). The gates and expert ids travel raw in the same
buffer (the routing is exact; the gates keep their gradients).

Where the node copy is decoded: at the relay, before the fan-out. The fan-out and its way back
then carry raw rows over the intra-node links. The relay has to decode in combine anyway (the
gated partial sum is arithmetic on the expert outputs), decoding once per (token, node) costs
less than once per (token, expert) on the expert ranks, and intra-node links (NVLink-class,
one to two orders of magnitude faster than the inter-node network) gain little from
compression; encoding only the inter-node hop also keeps one quantisation per direction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.comm.alltoall.blocks import take
from moeflow.schedule.pipeline import pack, unpack


def exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group,
                  remote: list[bool], counter: torch.Tensor | None) -> torch.Tensor:
    """One ``all_to_all_single``; adds to ``counter`` the bytes sent to peers marked remote."""
    x = x.contiguous()
    if counter is not None and x.shape[0]:
        row = x.element_size() * (x.numel() // x.shape[0])
        counter.add_(sum(s for s, r in zip(send, remote) if r) * row)
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(recv),
                           input_split_sizes=list(send), group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Differentiable raw all-to-all: the backward is the reverse exchange (same links)."""

    @staticmethod
    def forward(ctx, x, send, recv, group, remote, counter):
        ctx.args = (send, recv, group, remote, counter)
        return exchange_rows(x, send, recv, group, remote, counter)

    @staticmethod
    def backward(ctx, g):
        send, recv, group, remote, counter = ctx.args
        return exchange_rows(g, recv, send, group, remote, counter), None, None, None, None, None


@dataclass
class Hop:
    """One inter-node hop: splits, group, which peers are remote, the byte counter, the
    codecs (forward, backward) and the non-finite counter (``ScheduledExperts``'s)."""
    send: list[int]
    recv: list[int]
    group: object
    remote: list[bool]
    counter: torch.Tensor | None
    codec: object
    backward_codec: object
    nonfinite: torch.Tensor | None

    def reversed(self) -> "Hop":
        return Hop(self.recv, self.send, self.group, self.remote, self.counter, self.codec,
                   self.backward_codec, self.nonfinite)


def _coded(hop: Hop, codec, coded: torch.Tensor, raw: list[torch.Tensor], send, recv):
    """Encode ``coded``, pack it with the ``raw`` tensors (same rows) into one buffer, exchange
    it, unpack and decode: ``[coded', *raw']``."""
    if hop.nonfinite is not None and not codec.represents_nonfinite:
        hop.nonfinite.add_(torch.isfinite(coded).logical_not().sum())
    payloads = codec.encode(coded.contiguous())
    buf, layout = pack(payloads + [t.contiguous() for t in raw])
    got = unpack(exchange_rows(buf, send, recv, hop.group, hop.remote, hop.counter), layout)
    n = len(payloads)
    return [codec.decode(got[:n], coded.dtype)] + got[n:]


def hop_backward(hop: Hop, g: torch.Tensor, graw: list[torch.Tensor]) -> list[torch.Tensor]:
    """The backward of a :class:`CodedAllToAll` over ``hop``: the gradient of ``coded``
    through the backward codec and those of the float ``raw`` tensors, the reverse way, in one
    collective: ``[g_coded', *g_raw']``. Called by autograd, and by the scheduled backward's
    lane tasks (:mod:`moeflow.strategies.node_dedup.backward`)."""
    return _coded(hop, hop.backward_codec, g, graw, hop.recv, hop.send)


def gated_sum_backward(full: torch.Tensor, gates: torch.Tensor, on: torch.Tensor,
                       g_partial: torch.Tensor, gate_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of the relay's gated partial sum ``partial = sum_c full[:, c] * gates[:,
    c]`` with ``gates = (gate_r * on).to(full.dtype)``: the gradients of ``full`` (R k rows)
    and of ``gate_r`` (R, k), as autograd computes them."""
    R, k = on.shape
    g3 = g_partial.unsqueeze(1)
    g_full = (g3 * gates.unsqueeze(-1)).reshape(R * k, g_partial.shape[1])
    g_gate = (full.view(R, k, full.shape[1]) * g3).sum(-1).to(gate_dtype) * on.to(gate_dtype)
    return g_full, g_gate


@dataclass
class DedupStage:
    """One call's node-deduplicated exchange as scheduled tasks: ``forward``, the seven task
    functions (their C1 reads the chunk's rows of the send buffer from its argument when one
    is given, else from the send buffer); ``a1_back(i, g_fanned, g_gate)`` and ``a2_back(i,
    g_back)``, the explicit backward of the chunk's two lane tasks (hops and the index
    arithmetic between them, no autograd: they run on the lane thread), returning the
    gradients of A1's inputs ``(x, gates)`` and of A2's input and of A1's gate output
    ``(out, g_gate)``."""
    forward: object             # moeflow.schedule.executor.Stage
    a1_back: object
    a2_back: object


class CodedAllToAll(torch.autograd.Function):
    """An inter-node hop of ``(coded, *raw)``: ``coded`` through the codec, the others raw,
    in one collective. Straight through: the backward sends the gradients (of ``coded`` through
    the backward codec) the reverse way. Integer tensors (expert ids) get no gradient."""

    @staticmethod
    def forward(ctx, hop: Hop, coded, *raw):
        ctx.hop = hop
        ctx.shapes = [(t.shape, t.dtype) for t in raw]
        out = _coded(hop, hop.codec, coded, list(raw), hop.send, hop.recv)
        ctx.mark_non_differentiable(*[t for t in out[1:] if not t.is_floating_point()])
        return tuple(out)

    @staticmethod
    def backward(ctx, g, *graw):
        floats = [i for i, (_, dt) in enumerate(ctx.shapes) if dt.is_floating_point]
        raw = [graw[i] if graw[i] is not None else g.new_zeros(ctx.shapes[i][0][1:]).expand(
            g.shape[0], *ctx.shapes[i][0][1:]) for i in floats]
        got = hop_backward(ctx.hop, g, raw)
        grads = [None] * len(ctx.shapes)
        for i, t in zip(floats, got[1:]):
            grads[i] = t
        return (None, got[0], *grads)


def take_in_graph(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """:func:`~moeflow.comm.alltoall.blocks.take` that stays in ``x``'s graph when empty: every
    rank must run the same backward collectives, so no exchange may drop out of the graph."""
    return take(x, sizes, order) if any(sizes) else x.narrow(0, 0, 0)
