"""Node-deduplicated dispatch and combine (``MoEConfig(a2a="node_dedup")``).

The hierarchical exchange of DeepEP's inter-node kernels and Megatron-core's flex dispatcher
(and SMILE section 3.2.3's two stages, made token-aware): rank (n, l) = node n, local rank l.

Dispatch
  1. For every token, the distinct nodes holding one of its k experts. The token goes once to
     each such node m, to rank (m, l), with its k expert ids and k gate weights (an
     inter-node all-to-all among the ranks of local rank l).
  2. The relay (m, l) fans each received token out to the ranks of node m holding its experts
     there (an intra-node all-to-all), expert-major, and the experts run.
Combine (the mirror)
  3. The expert outputs go back to the relay (intra-node), which weights them by their gates
     and sums them per received token: one partial sum per (token, node).
  4. The partial sums cross back (inter-node) and each token sums its nodes' partials.
Inter-node rows per dispatch and per combine are (tokens x distinct destination nodes)
instead of (tokens x k). The split sizes of the two exchanges are
:func:`moeflow.dispatch.phases.node_dedup_phases` (which the step simulator models too). The
backward is the mirror, by autograd through differentiable all-to-alls: the gradients of the
partial sums cross once per (token, node), and the gradients of the tokens and gates once per
(token, node) the other way.

One count exchange per call (one host synchronisation, as dropless ``direct``): every rank
all-gathers its choices per expert and its tokens per destination node, from which every
split size follows on the host. The collectives run on the computing thread (no lane work is
in flight: docs/design.md, "One collective order per rank"), in an order fixed by the code;
backward's by autograd's order, the same graph on every rank.

Supported: dropless and capacity mode (GShard's drops decided on the source rank, as with
``direct``; only kept choices travel, so capacity mode also learns its counts on the host once,
like ``capacity_padding="trim"``), codec ``none``, ``pipeline_degree=1``, every router, shared
experts, BigMac and the other structures. Refused with a ConfigError at construction:
``capacity_padding="pad"``, other codecs, pipelining degree above 1, ``schedule="auto"``,
Parm and FSSDP placements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.comm.alltoall.blocks import take
from moeflow.comm.exchange import gather_device_counts
from moeflow.dispatch import DispatchPlan, make_plan
from moeflow.dispatch.phases import kept_choices, node_dedup_phases, token_nodes
from moeflow.errors import ConfigError
from moeflow.strategies.base import ExpertStrategy

_FIX = "or use a2a='direct' / 'bilevel'"


def check_config(cfg, topo) -> None:
    """Raise ConfigError for what node_dedup does not run with (yet)."""
    def refuse(field: str, value, fix: str) -> None:
        raise ConfigError(f"MoEConfig.{field}={value!r} cannot be combined with "
                          f"a2a='node_dedup' yet: {fix}, {_FIX}")
    if cfg.capacity_padding == "pad":
        refuse("capacity_padding", cfg.capacity_padding,
               "node_dedup sends only the kept rows (the counts come to the host once, as "
               "'trim'); use capacity_padding='auto' or 'trim'")
    if cfg.codec != "none":
        refuse("codec", cfg.codec, "its exchanges send raw rows; use codec='none'")
    if cfg.pipeline_degree != 1:
        refuse("pipeline_degree", cfg.pipeline_degree,
               "its exchange is not pipelined; use pipeline_degree=1")
    if cfg.schedule == "auto":
        refuse("schedule", cfg.schedule, "nothing is scheduled at degree 1; use "
               "schedule='sequential'")
    if cfg.placement != "ep":
        refuse("placement", cfg.placement, "it places whole experts; use placement='ep'")
    if topo.esp_size > 1 or topo.mp_size > 1:
        raise ConfigError(f"a2a='node_dedup' cannot be combined with Parm's MP/ESP "
                          f"(mp_size={topo.mp_size}, esp_size={topo.esp_size}) yet: use "
                          f"mp_size=esp_size=1, {_FIX}")


@dataclass
class NodeDedupPlan(DispatchPlan):
    experts: torch.Tensor | None = None      # (T, k) expert ids of this rank's tokens


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group, remote: list[bool],
              counter: torch.Tensor | None) -> torch.Tensor:
    """One ``all_to_all_single``; adds to ``counter`` the bytes sent to peers marked remote."""
    x = x.contiguous()
    if counter is not None and x.shape[0]:
        row = x.element_size() * (x.numel() // x.shape[0])
        counter.add_(sum(s for s, r in zip(send, remote) if r) * row)
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(recv),
                           input_split_sizes=list(send), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the backward is the reverse exchange (same links)."""

    @staticmethod
    def forward(ctx, x, send, recv, group, remote, counter):
        ctx.args = (send, recv, group, remote, counter)
        return _exchange(x, send, recv, group, remote, counter)

    @staticmethod
    def backward(ctx, g):
        send, recv, group, remote, counter = ctx.args
        return _exchange(g, recv, send, group, remote, counter), None, None, None, None, None


def _take(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """:func:`~moeflow.comm.alltoall.blocks.take` that stays in ``x``'s graph when empty: every
    rank must run the same backward collectives, so no exchange may drop out of the graph."""
    return take(x, sizes, order) if any(sizes) else x.narrow(0, 0, 0)


class NodeDedup(ExpertStrategy):
    """Whole experts on their EP rank (EP = the world), reached through the node-deduplicated
    exchange above; the gate weights travel with the token, so the combine happens inside
    :meth:`exchange` and the layer's combine is the identity."""

    name = "node_dedup"
    trims_padding = False

    def __init__(self, layer) -> None:
        super().__init__(layer)
        check_config(layer.cfg, layer.topo)

    def plan(self, expert_ids, cap, device, call) -> NodeDedupPlan:
        """Dropless: every choice. Capacity: GShard's slots decide on this rank's tokens, as
        with ``direct``; a dropped choice gets the id E (no node) and travels nowhere."""
        E = self.layer.cfg.num_experts
        p = make_plan(expert_ids, E, cap)
        if cap is not None:
            expert_ids, p.local_counts = kept_choices(expert_ids, p.slot, p.send_rows, E)
        return NodeDedupPlan(**{f: getattr(p, f) for f in p.__dataclass_fields__},
                             experts=expert_ids)

    def permute(self, h: torch.Tensor, plan, weights: torch.Tensor) -> torch.Tensor:
        """The token and its k gate weights, one row: they travel together."""
        return torch.cat([h, weights.to(h.dtype)], 1)

    def combine(self, back: torch.Tensor, plan, weights: torch.Tensor) -> torch.Tensor:
        return back                                     # summed inside exchange

    def exchange(self, send, plan: NodeDedupPlan, runner, tokens, call):
        topo, cfg = self.layer.topo, self.layer.cfg
        counter = runner.inter_node_bytes
        N, L, n, l = topo.num_nodes, topo.local_size, topo.node_rank, topo.local_rank
        P, E, k, T = topo.world_size, cfg.num_experts, plan.top_k, plan.num_tokens
        El = E // P
        En = El * L                                     # experts per node
        M = send.shape[1] - k
        g = lambda node, local: node * L + local        # noqa: E731
        ids = plan.experts
        # 1. the distinct destination nodes of every token; the one count exchange
        hit = token_nodes(ids, En, N)                   # dropped choices reach no node
        pair_counts = hit.sum(0).to(plan.local_counts.dtype)
        got = gather_device_counts(torch.cat([plan.local_counts, pair_counts]),
                                   topo.world_group, P)          # the host synchronisation
        NE, C = got[:, :E], got[:, E:]                  # choices per expert, pairs per node
        plan.counts, plan.ep_rank = NE, topo.ep_rank
        me = g(n, l)
        # (token, node) pairs, node-major: a stable sort puts the hits first, in order
        flat = hit.t().reshape(-1)
        n_pairs = int(C[me].sum())
        pair = torch.argsort(flat.logical_not().to(torch.int32), stable=True)[:n_pairs]
        pair_tok = torch.remainder(pair, T) if T else pair
        inter_phase, intra_phase = node_dedup_phases(NE, C, N, L, El, n, l)
        send_a, recv_a = inter_phase.send, inter_phase.recv
        remote_a = [m != n for m in range(N)]
        inter = topo.inter_node_group
        rows_a = _AllToAll.apply(send.index_select(0, pair_tok), send_a, recv_a, inter,
                                 remote_a, counter)
        ids_a = _exchange(ids.index_select(0, pair_tok).to(torch.int32), send_a, recv_a, inter,
                          remote_a, counter).long()          # 4 bytes per id on the wire
        R = ids_a.shape[0]
        x_r, gate_r = rows_a[:, :M], rows_a[:, M:]
        # 2. fan out inside the node: the choices on this node, by local expert
        on = (ids_a // En) == n
        key = torch.where(on, ids_a - n * En, En).reshape(-1)
        send_b, recv_b = intra_phase.send, intra_phase.recv
        sel = torch.argsort(key, stable=True)[:sum(send_b)]          # choice r*k + j
        remote_b = [False] * L
        intra = topo.intra_node_group
        rows_b = x_r.index_select(0, torch.div(sel, k, rounding_mode="floor"))
        if L > 1:
            rows_b = _AllToAll.apply(rows_b, send_b, recv_b, intra, remote_b, None)
        # received: per relay l1, expert-major over this rank's experts -> expert-major
        first = me * El
        sizes = [sum(int(NE[g(s, l1), first + e]) for s in range(N))
                 for l1 in range(L) for e in range(El)]
        to_experts = [l1 * El + e for e in range(El) for l1 in range(L)]
        grouped = _take(rows_b, sizes, to_experts)
        counts = [sum(sizes[l1 * El + e] for l1 in range(L)) for e in range(El)]
        out = runner.experts(grouped, counts)
        if not any(counts):              # no rows: keep the way back in the graph (see _take)
            out = out.new_zeros(0, out.shape[1]) + grouped.sum() * 0
        back_sizes = [sizes[i] for i in to_experts]
        out = _take(out, back_sizes, [e * L + l1 for l1 in range(L) for e in range(El)])
        # 3. back to the relay; gated sum per received token (this node's partial sum)
        if L > 1:
            out = _AllToAll.apply(out, recv_b, send_b, intra, remote_b, None)
        full = out.new_zeros(R * k, out.shape[1]).index_copy(0, sel, out)
        gates = (gate_r * on.to(gate_r.dtype)).to(full.dtype)   # as direct's combine
        partial = (full.view(R, k, full.shape[1]) * gates.unsqueeze(-1)).sum(1)
        # 4. the partial sums cross back once per (token, node); each token sums its nodes'
        back = _AllToAll.apply(partial, recv_a, send_a, inter, remote_a, counter)
        y = back.new_zeros(N * T, back.shape[1]).index_copy(0, pair, back)
        return y.view(N, T, y.shape[1]).sum(0), None
