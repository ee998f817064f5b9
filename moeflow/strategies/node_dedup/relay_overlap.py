"""The relay's two hops overlapped, per source node: DeepEP's normal mode (its ``internode``
dispatch forwards over NVLink the tokens already received over RDMA while the rest are in
flight, and its combine sends each reduced chunk back over RDMA while it still reduces the
next; the IB-then-NVLink all-to-all of DeepSeek-V3 section 3.2.2).

The trimmed exchange (:mod:`moeflow.strategies.node_dedup.trimmed`) with several ranks per
node runs its inter-node hop as ``N - 1`` asynchronous steps among the ranks of local rank l:
in step j (j = 1 .. N-1) rank (n, l) sends its rows for node ``n + j`` and receives those of
node ``n - j`` (mod N; each step one all-to-all of the inter-node group with one non-empty
block per rank), and its own node's rows (step 0) need no link. Dispatch posts every step at
once, forwards its own node's rows inside the node at once, then each source node's rows as
they land (``n - 1``, ``n - 2``, ...), one intra-node all-to-all per source node. Combine
reduces and returns the remote source nodes' rows first, each sum crossing back
(asynchronously) while the next source node's partial rows are gathered inside the node, its
own node's last.

The scheduled backward's lane tasks
(:class:`~moeflow.strategies.node_dedup.steps.DedupStage`) run the same two functions in the
mirrored roles, through the backward codec: the partial sums' gradients go out as a dispatch
(forwarded to the expert ranks as they land), the copies' gradients come back as a combine.
The rows, their order and every sum are those of the one-shot exchange (the pieces are put
back in its layout), so the values and the bytes counted are the same. Every rank of a group
issues that group's collectives in one order (the steps in j's order, the forwarding per source
node in the same order on every rank of the node), on the lane thread; every wait is bounded by
the group's timeout (:func:`moeflow.comm.sparse.wait_work`); no device value is read on the
host (the split sizes are the count exchange's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.comm.alltoall.blocks import offsets
from moeflow.comm.sparse import group_timeout, wait_work
from moeflow.schedule.pipeline import pack, unpack
from moeflow.strategies.node_dedup.steps import Hop, exchange_rows


@dataclass
class SourceSplits:
    """One chunk's splits per source node s of the relay's rows: ``send_b[s][l2]`` rows the
    relay forwards to local rank l2 from s, ``recv_b[s][l1]`` rows this rank gets from relay
    l1 from s (the one-shot fan-out's splits are their sums over s)."""
    send_b: list[list[int]]
    recv_b: list[list[int]]


def step_order(N: int, n: int) -> list[tuple[int, int]]:
    """Node n's inter-node steps j = 1 .. N-1 as ``(to, from)``: send to node ``n + j``,
    receive from node ``n - j`` (mod N)."""
    return [((n + j) % N, (n - j) % N) for j in range(1, N)]


class _Posted:
    """The asynchronous inter-node steps of one hop: step j's output and work handle."""

    def __init__(self, device: torch.device, timeout):
        self.device, self.timeout = device, timeout
        self.pending: dict[int, tuple[torch.Tensor, object]] = {}

    def post(self, buf: torch.Tensor, to: int, rows_to: int, off_to: int, frm: int,
             rows_from: int, hop: Hop, N: int) -> None:
        """Send ``rows_to`` rows of ``buf`` from ``off_to`` to node ``to``, receive
        ``rows_from`` from node ``frm`` (keyed by ``frm``); counts the bytes sent as
        :func:`~moeflow.strategies.node_dedup.steps.exchange_rows` does."""
        send, recv = [0] * N, [0] * N
        send[to], recv[frm] = rows_to, rows_from
        x = buf.narrow(0, off_to, rows_to).contiguous()
        if hop.counter is not None and rows_to and hop.remote[to]:
            hop.counter.add_(rows_to * x.element_size() * (x.numel() // rows_to))
        out = buf.new_empty((rows_from,) + tuple(buf.shape[1:]))
        work = dist.all_to_all_single(out, x, output_split_sizes=recv,
                                      input_split_sizes=send, group=hop.group, async_op=True)
        self.pending[frm] = (out, work)

    def take(self, frm: int) -> torch.Tensor:
        out, work = self.pending.pop(frm)
        wait_work(work, self.timeout, self.device)
        return out


def _encoded(hop: Hop, codec, coded: torch.Tensor, raw: list[torch.Tensor]):
    """``_coded``'s sending half: the non-finite count, the encoding and the packed buffer."""
    if hop.nonfinite is not None and not codec.represents_nonfinite:
        hop.nonfinite.add_(torch.isfinite(coded).logical_not().sum())
    payloads = codec.encode(coded.contiguous())    # pack rebuilds an empty payload's strides
    buf, layout = pack(payloads + [t.contiguous() for t in raw])
    return buf, layout, len(payloads)


def _decoded(codec, got: torch.Tensor, layout, n: int, dtype) -> list[torch.Tensor]:
    parts = unpack(got, layout)
    return [codec.decode(parts[:n], dtype)] + parts[n:]


def overlapped_dispatch(hop: Hop, codec, fan: Hop, splits: SourceSplits, n: int, N: int,
                        L: int, coded: torch.Tensor, raw: list[torch.Tensor], select
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """The inter-node hop of ``[coded, *raw]`` (same rows, per destination node:
    ``hop.send``; ``coded`` through ``codec``) and the relay's forwarding inside the node,
    overlapped per source node. ``select(s, rows)``: the relay's rows to forward among source
    node s's decoded rows ``[coded, *raw]``, destination-rank-major. Returns the received and
    the forwarded ``[coded, *raw]`` in the one-shot exchange's layouts, and per source node
    ``select``'s rows."""
    buf, layout, nc = _encoded(hop, codec, coded, raw)
    posted = _Posted(buf.device, group_timeout(hop.group))
    off = offsets(hop.send)
    for to, frm in step_order(N, n):                     # every step in flight at once
        posted.post(buf, to, hop.send[to], off[to], frm, hop.recv[frm], hop, N)
    got_r: dict[int, list[torch.Tensor]] = {}
    sels: dict[int, torch.Tensor] = {}
    got_b: dict[int, list[torch.Tensor]] = {}
    for s in [n] + [frm for _, frm in step_order(N, n)]:   # own node first, then as landed
        rows = buf.narrow(0, off[n], hop.send[n]) if s == n else posted.take(s)
        got_r[s] = _decoded(codec, rows, layout, nc, coded.dtype)
        sels[s] = sel = select(s, got_r[s])
        got_b[s] = _raw_exchange(fan, [t.index_select(0, sel) for t in got_r[s]],
                                 splits.send_b[s], splits.recv_b[s])
    width = 1 + len(raw)
    received = [torch.cat([got_r[s][t] for s in range(N)]) for t in range(width)]
    # the one-shot fan-out's layout: [relay l1][source node s]
    rb = [offsets(splits.recv_b[s]) for s in range(N)]
    forwarded = [torch.cat([got_b[s][t].narrow(0, rb[s][l1], splits.recv_b[s][l1])
                            for l1 in range(L) for s in range(N)]) for t in range(width)]
    return received, forwarded, sels


def _raw_exchange(fan: Hop, parts: list[torch.Tensor], send: list[int],
                  recv: list[int]) -> list[torch.Tensor]:
    """One raw all-to-all of the intra-node group for ``parts`` (same rows), packed."""
    buf, layout = pack([t.contiguous() for t in parts])
    return unpack(exchange_rows(buf, send, recv, fan.group, fan.remote, fan.counter), layout)


def overlapped_combine(hop: Hop, codec, fan: Hop, splits: SourceSplits, n: int, N: int,
                       L: int, parts: list[torch.Tensor], row_b: dict[int, torch.Tensor]
                       ) -> list[torch.Tensor]:
    """The mirror: ``parts = [coded, *raw]`` (one row per copy this rank got, in the one-shot
    fan-out's layout) back to the relays per source node, summed there per (token, node)
    (``row_b[s]``: the relay's forwarded rows of source node s, as it selected them), each
    node's sums crossing back (``coded`` through ``codec``) asynchronously while the next
    source node's are gathered; the own node's last, without a link. Returns ``[coded,
    *raw]`` as this rank gets them back, per destination node in its dispatch order (the
    one-shot hop's)."""
    blocks = offsets([splits.recv_b[s][l1] for l1 in range(L) for s in range(N)])
    posted = _Posted(parts[0].device, group_timeout(hop.group))
    mine = layout = nc = None
    for s, frm in [(frm, to) for to, frm in step_order(N, n)] + [(n, n)]:
        # the sums of source node s go back to it; node frm's sums for this rank come in
        pieces = [torch.cat([t.narrow(0, blocks[l1 * N + s], splits.recv_b[s][l1])
                             for l1 in range(L)]) for t in parts]
        got = _raw_exchange(fan, pieces, splits.recv_b[s], splits.send_b[s])
        sums = [t.new_zeros((hop.recv[s],) + tuple(t.shape[1:])).index_add(0, row_b[s], t)
                for t in got]
        buf, layout, nc = _encoded(hop, codec, sums[0], sums[1:])
        if s == n:
            mine = buf
        else:
            posted.post(buf, s, hop.recv[s], 0, frm, hop.send[frm], hop, N)
    back = [mine if m == n else posted.take(m) for m in range(N)]
    return _decoded(codec, torch.cat(back), layout, nc, parts[0].dtype)


class Overlapped(torch.autograd.Function):
    """A lane task's overlapped hops as one autograd node (recorded only where the lane task
    runs with grad enabled: one chunk under saved-tensor hooks,
    :mod:`moeflow.strategies.node_dedup.backward`): ``run(*inputs)`` gives the outputs,
    ``back(*output_grads)`` the inputs' gradients, the scheduled backward's explicit
    arithmetic and hops (the same collectives, in one order, on every rank)."""

    @staticmethod
    def forward(ctx, run, back, *inputs):
        ctx.back = back
        outs = tuple(run(*inputs))
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.back(*grads))
