"""The node-deduplicated exchange with split sizes from exchanged counts (dropless, and trimmed
capacity mode): DeepEP's normal-mode data flow (DeepEP's ``internode`` dispatch / combine,
the kernels behind DeepSeek-V3 section 3.2.2's IB-then-NVLink all-to-all).

Per chunk of consecutive tokens (:mod:`moeflow.strategies.node_dedup.steps`' seven tasks):

* dispatch, inter-node: rank (n, l) sends each token once to each node m holding one of its
  experts, to the relay (m, l), with its k gates and k int32 expert ids (one row per (token,
  node); DeepEP's ``num_tokens_per_rdma_rank`` / ``is_token_in_rank`` layout);
* dispatch, inside the node: the relay forwards the token once to each of its node's ranks
  holding one of its experts (one row per (token, rank), not per choice: DeepEP's
  ``num_tokens_per_rank`` forwarding over NVLink), the k gates in the same row, the ids beside;
  the expert rank makes the rows of its own choices locally (copies on the device, no link);
* combine: the expert rank sums its own choices' gated outputs (one partial row per (token,
  rank)), the relay sums its node's ranks' partial rows (one per (token, node)), which cross
  back once; the token's rank sums its nodes' (DeepEP's combine, reduced per rank over NVLink
  and per node before RDMA).

With several ranks per node the two hops of a chunk overlap per source node as DeepEP's
normal mode overlaps its RDMA sends and NVLink forwarding
(:mod:`moeflow.strategies.node_dedup.relay_overlap`: the relay forwards what has landed while the
other nodes' rows are in flight, and returns each node's sums while it gathers the next);
with one rank per node the relay is the expert rank and each hop is one collective.

Every split size comes from one count exchange per call (per chunk: choices per expert,
tokens per destination node and, with several ranks per node, tokens per destination rank,
all in one all-gather), the
host synchronisation that DeepEP's normal mode also makes (its CPU waits for the received
counts). The lane tasks' backward is explicit (:class:`~.steps.DedupStage`); the bytes the
intra-node hops carry go to the strategy's ``intra_node_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeflow.comm.alltoall.phases import token_nodes
from moeflow.comm.codecs import CODECS
from moeflow.comm.exchange import gather_device_counts
from moeflow.schedule.executor import Stage
from moeflow.strategies.node_dedup.relay_overlap import (Overlapped, SourceSplits,
                                                   overlapped_combine, overlapped_dispatch)
from moeflow.strategies.node_dedup.steps import (CodedAllToAll, DedupStage, Hop,
                                                 gated_sum_backward, hop_backward)


@dataclass
class RankLayout:
    """Host splits of one chunk (tokens ``[lo, hi)`` of this rank), from every rank's counts
    for the chunk ``G = [NE | C | R]``: ``NE[p, e]`` choices of rank p for expert e,
    ``C[p, m]`` its tokens with an expert on node m, ``R[p, q]`` its tokens with an expert on
    rank q."""
    lo: int
    hi: int
    n_pairs: int            # this rank's (token, node) pairs
    send_a: list[int]       # inter-node hop (among the ranks of local rank l): pairs per node
    recv_a: list[int]
    send_b: list[int]       # the relay's copies per local rank of its node
    recv_b: list[int]
    counts: list[int]       # rows per local expert (its choices, all sources)
    by_source: SourceSplits | None = None    # the fan-out per source node (L > 1)

    @classmethod
    def build(cls, G: np.ndarray, lo: int, hi: int, topo, El: int, E: int) -> "RankLayout":
        N, L, n, l = topo.num_nodes, topo.local_size, topo.node_rank, topo.local_rank
        P = N * L
        g = lambda node, local: node * L + local        # noqa: E731
        me = g(n, l)
        NE, C, R = G[:, :E], G[:, E:E + N], G[:, E + N:]
        recv_a = [int(C[g(s, l), n]) for s in range(N)]
        by_source = None
        if L == 1:          # the relay is the expert rank: it keeps every copy it received
            send_b = recv_b = [sum(recv_a)]
        else:
            by_source = SourceSplits(
                [[int(R[g(s, l), g(n, l2)]) for l2 in range(L)] for s in range(N)],
                [[int(R[g(s, l1), me]) for l1 in range(L)] for s in range(N)])
            send_b = [sum(b[l2] for b in by_source.send_b) for l2 in range(L)]
            recv_b = [sum(b[l1] for b in by_source.recv_b) for l1 in range(L)]
        return cls(lo, hi, int(C[me].sum()), send_a=[int(c) for c in C[me]], recv_a=recv_a,
                   send_b=send_b, recv_b=recv_b,
                   counts=[sum(int(NE[p, me * El + e]) for p in range(P)) for e in range(El)],
                   by_source=by_source)


def _selected(flags: torch.Tensor, count: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` set entries of ``flags`` (rows x D, read column-major: destination-major,
    row order inside): their flat positions and rows."""
    flat = flags.t().reshape(-1)
    pair = torch.argsort(flat.logical_not().to(torch.int32), stable=True)[:count]
    return pair, (torch.remainder(pair, rows) if rows else pair)


def relay_rows(ids_r: torch.Tensor, count: int, En: int, El: int, n: int,
               L: int) -> torch.Tensor:
    """The relay's copies of its received rows (expert ids ``ids_r``, ``En`` experts per
    node, ``El`` per rank, this is node n of L ranks each): one per (row, rank of node n with
    one of its experts), destination-rank-major (``count`` of them, from the count exchange)."""
    R = ids_r.shape[0]
    local = torch.where((ids_r // En) == n, ids_r // El - n * L, L)
    to = torch.zeros(R, L + 1, dtype=torch.bool, device=ids_r.device)
    to = to.scatter_(1, local, True)[:, :L]
    return _selected(to, count, R)[1]


def trimmed_stage(strategy, send: torch.Tensor, plan, runner) -> "DedupStage":
    """The seven task functions over r chunks and their lane tasks' backward (collective: the
    count exchange first, unless ``plan`` holds the first forward's)."""
    layer = strategy.layer
    topo, cfg = layer.topo, layer.cfg
    N, L, n, l = topo.num_nodes, topo.local_size, topo.node_rank, topo.local_rank
    P, E, k, T = topo.world_size, cfg.num_experts, plan.top_k, plan.num_tokens
    El, r = E // P, runner.r
    En = El * L                                     # experts per node
    me = n * L + l
    M = send.shape[1] - k
    ids = plan.experts
    bounds = [(i * T) // r for i in range(r + 1)]
    hit = token_nodes(ids, En, N)                   # (T, N); dropped choices reach no node
    got = plan.gathered_for(r)      # a recomputation: the first forward's, not again
    if got is None:
        # per chunk: choices per expert, tokens per node and (several ranks per node: the
        # forwarding inside it) tokens per rank
        on_rank = token_nodes(ids, El, P) if L > 1 else hit[:, :0]   # (T, P): on rank q
        mine = []
        for lo, hi in zip(bounds, bounds[1:]):
            flat = ids[lo:hi].reshape(-1)
            mine += [flat.new_zeros(E + 1).index_add_(0, flat, torch.ones_like(flat))[:E],
                     hit[lo:hi].sum(0).to(flat.dtype), on_rank[lo:hi].sum(0).to(flat.dtype)]
        got = gather_device_counts(torch.cat(mine), topo.world_group,
                                   P).reshape(P, r, E + N + on_rank.shape[1])
        plan.gathered = (r, got)
    plan.counts, plan.ep_rank = got[:, :, :E].sum(1), topo.ep_rank
    lays = [RankLayout.build(got[:, i], bounds[i], bounds[i + 1], topo, El, E)
            for i in range(r)]
    inter, intra = topo.inter_node_group, topo.intra_node_group
    remote_a, other_b = [m != n for m in range(N)], [j != l for j in range(L)]
    intra_bytes = strategy.intra_node_bytes
    raw = CODECS["none"]()
    grad_on = torch.is_grad_enabled()
    state: dict[int, tuple] = {}
    sources: dict[int, dict] = {}       # per chunk: the relay's rows per source node

    def hop(lay: RankLayout) -> Hop:
        return Hop(lay.send_a, lay.recv_a, inter, remote_a, runner.inter_node_bytes,
                   runner.codec, runner.backward_codec, runner.nonfinite)

    def fan(lay: RankLayout) -> Hop:
        """The relay's copies to the ranks of its node: raw (no codec), counted as intra."""
        return Hop(lay.send_b, lay.recv_b, intra, other_b, intra_bytes, raw, raw, None)

    def c1(i, src):
        lay = lays[i]
        pair, tok = _selected(hit[lay.lo:lay.hi], lay.n_pairs, lay.hi - lay.lo)
        src = send[lay.lo:lay.hi] if src is None else src
        rows = src.index_select(0, tok)
        idp = ids[lay.lo:lay.hi].index_select(0, tok).to(torch.int32)  # 4 bytes per id
        state[i] = (pair,)
        return (rows[:, :M], rows[:, M:], idp), rows.numel()

    def fan_rows(ids_r: torch.Tensor, count: int) -> torch.Tensor:
        return relay_rows(ids_r, count, En, El, n, L)

    def dispatch_overlapped(i, x, gates, idp):
        """Inter-node hop and forwarding overlapped per source node (:mod:`.overlap`)."""
        lay = lays[i]

        def select(s, rows):
            return fan_rows(rows[2].long(), sum(lay.by_source.send_b[s]))
        (x_r, gate_r, ids_r), fwd, by_node = overlapped_dispatch(
            hop(lay), runner.codec, fan(lay), lay.by_source, n, N, L, x, [gates, idp], select)
        R = x_r.shape[0]
        row_b = fan_rows(ids_r.long(), sum(lay.send_b))
        sources[i] = by_node
        return fwd, (gate_r, row_b, R, x_r.numel() * x_r.element_size())

    def a1(i, p):
        lay = lays[i]
        with torch.set_grad_enabled(grad_on):       # grad mode is per thread
            if L > 1:
                held = []
                x_b, gate_b, ids_b = Overlapped.apply(
                    lambda *t: _hold(held, dispatch_overlapped(i, *t)),
                    lambda gx, gg, _: (*a1_grads(i, gx, gg), None), *p)
                gate_r, row_b, R, size = held[0]
            else:                       # the relay is the expert rank: nothing to forward
                x_r, gate_r, ids_r = CodedAllToAll.apply(hop(lay), *p)
                R, size = x_r.shape[0], x_r.numel() * x_r.element_size()
                row_b = fan_rows(ids_r.long(), sum(lay.send_b))
                x_b, gate_b, ids_b = (t.index_select(0, row_b) for t in (x_r, gate_r, ids_r))
            ids_b = ids_b.long()
            # the expert rank: its own choices among each copy's k, by local expert
            mine = (ids_b // El) == me
            key = torch.where(mine, ids_b - me * El, El).reshape(-1)
            sel = torch.argsort(key, stable=True)[:sum(lay.counts)]        # copy * k + j
        state[i] += (gate_r, row_b, R, mine, sel, gate_b)
        return x_b, size

    def d1(i, x_b):                 # size: the rows it makes (one per choice)
        sel = state[i][5]
        grouped = x_b.index_select(0, torch.div(sel, k, rounding_mode="floor"))
        return grouped, grouped.numel()

    def experts(i, grouped):
        counts = lays[i].counts
        out = runner.experts(grouped, counts)
        if not any(counts):          # no rows: keep the way back in the graph
            out = out.new_zeros(0, out.shape[1]) + grouped.sum() * 0
        return out, grouped.numel()

    def c2(i, out):                  # already in the order A2 gathers from
        return out.view_as(out), out.numel()

    def a2(i, out):
        lay = lays[i]
        _, gate_r, row_b, R, mine, sel, gate_b = state[i][:7]
        with torch.set_grad_enabled(grad_on):
            R2 = mine.shape[0]
            full = out.new_zeros(R2 * k, out.shape[1]).index_copy(0, sel, out)
            gates = (gate_b * mine.to(gate_b.dtype)).to(full.dtype)
            # reduced per rank: one partial row per (token, rank) goes back to the relay
            part = (full.view(R2, k, full.shape[1]) * gates.unsqueeze(-1)).sum(1)
            if L > 1:
                # per source node: back to the relay, summed per (token, node), crossing
                # back while the next source node's rows are summed (.overlap)
                (back,) = Overlapped.apply(
                    lambda pt: overlapped_combine(hop(lay), runner.codec, fan(lay),
                                                  lay.by_source, n, N, L, [pt], sources[i]),
                    lambda gb: (copies_grad(i, gb),), part)
            else:
                # reduced per node at the relay: one row per (token, node) crosses back
                partial = part.new_zeros(R, part.shape[1]).index_add(0, row_b, part)
                (back,) = CodedAllToAll.apply(hop(lay).reversed(), partial)
        state[i] += (full, gates)           # what the scheduled backward's a2_back needs
        return back, R * part.shape[1] * part.element_size()

    def d2(i, back):
        lay = lays[i]
        t = lay.hi - lay.lo
        y = back.new_zeros(N * t, back.shape[1]).index_copy(0, state[i][0], back)
        return y.view(N, t, y.shape[1]).sum(0), back.numel()

    # the backward of the lane tasks, mirrored (on the lane: explicit, no autograd)
    def a1_grads(i, g_x_b, g_gate_b):
        lay = lays[i]
        _, gate_r, row_b, R = state[i][:4]
        g_gate_b = g_gate_b.to(gate_r.dtype)
        if L > 1:               # the copies' reverse exchange, overlapped as A2 (.overlap)
            g_x, g_gates = overlapped_combine(hop(lay), runner.backward_codec, fan(lay),
                                              lay.by_source, n, N, L, [g_x_b, g_gate_b],
                                              sources[i])
            return g_x, g_gates
        g_x = g_x_b.new_zeros(R, M).index_add_(0, row_b, g_x_b)
        g_gate = gate_r.new_zeros(R, k).index_add_(0, row_b, g_gate_b)
        g_x, g_gates = hop_backward(hop(lay), g_x, [g_gate])   # once per (token, node)
        return g_x, g_gates

    def a1_back(i, g_x_b, g_gate_b):
        g_x, g_gates = a1_grads(i, g_x_b, g_gate_b)
        return (g_x, g_gates), g_x.numel() * g_x.element_size()

    def copies_grad(i, g_back):
        """The gradient of the per-rank partial rows from that of the rows back home."""
        lay = lays[i]
        if L > 1:               # the partial sums' gradients: overlapped as A1 (.overlap)
            _, fwd, _ = overlapped_dispatch(hop(lay), runner.backward_codec, fan(lay),
                                            lay.by_source, n, N, L, g_back, [],
                                            lambda s, rows: sources[i][s])
            return fwd[0]
        (g_partial,) = hop_backward(hop(lay).reversed(), g_back, [])
        return g_partial.index_select(0, state[i][2])

    def a2_back(i, g_back):
        _, gate_r, row_b, R, mine, sel, gate_b, full, gates = state[i]
        g_part = copies_grad(i, g_back)
        g_full, g_gate_b = gated_sum_backward(full, gates, mine, g_part, gate_b.dtype)
        return (g_full.index_select(0, sel), g_gate_b), g_back.numel() * g_back.element_size()

    return DedupStage(Stage({"C1": c1, "A1": a1, "D1": d1, "E": experts, "C2": c2,
                             "A2": a2, "D2": d2}), a1_back, a2_back)


def _hold(held: list, result):
    """``(outputs, kept)`` -> outputs, ``kept`` appended to ``held``."""
    held.append(result[1])
    return result[0]
