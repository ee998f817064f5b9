"""The node-deduplicated exchange in padded capacity mode (``a2a="node_dedup"`` with
``capacity_padding="pad"``, or ``"auto"`` on a GPU): fixed split sizes, no host read of device
counts (GShard section 2.2's capacity slots, laid out as Tutel / ``direct``'s padded mode
does, over DeepEP's two hops: :mod:`moeflow.strategies.node_dedup.strategy`).

Every split follows from the ranks' token counts ``T_q`` and capacities ``C_q`` (host
integers, one host all-gather per call, as padded ``direct`` gathers its ``C_q``; under
``MoEConfig.equal_rank_tokens`` once per distinct token count, :func:`padded_counts`):

* inter-node hop: rank q sends ``B_q = min(t_q, C_node(C_q))`` rows to every node (t_q: its
  chunk's tokens; ``C_node = ceil(E_node C_q p / k)``, the capacity per destination node of
  :mod:`moeflow.strategies.node_dedup.node_capacity`, ``E_node C_q`` unless the router limits a
  token to ``p < k`` nodes); a token with a kept choice on node m takes the next row of m's
  block, in token order (the plan dropped the copies past ``C_node``); the rest are padding
  (expert id E: no node; gates 0);
* fan-out: the relay places each kept choice for a local expert e of its node at slot
  ``position`` (GShard's slot, sent beside the ids) of the block (source node, e), ``C_q``
  rows per (source rank q, expert); the experts compute the empty slots, as padded ``direct``;
* the way back gathers the same rows (a gather, with a zero row for every empty one), gates
  and sums them at the relay and sums the nodes' partial sums at the token's rank.

With r > 1 chunks (consecutive tokens) every chunk pads its fan-out to the whole ``C_q`` slots
(a chunk's kept choices hold arbitrary slots), so the padded rows grow with r.
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.devices import to_device_async
from moeflow.dispatch.plan import gather_known
from moeflow.comm.alltoall.phases import token_nodes
from moeflow.schedule.executor import Stage
from moeflow.strategies.node_dedup.node_capacity import node_capacity
from moeflow.strategies.node_dedup.steps import (AllToAll, CodedAllToAll, DedupStage, Hop,
                                                 exchange_rows, gated_sum_backward,
                                                 hop_backward, take_in_graph)


def padded_counts(plan, group, size: int) -> np.ndarray:
    """Every rank's ``[T_q, C_q]`` (``(size, 2)`` host integers): one host all-gather per call,
    or with ``plan.known`` (``MoEConfig.equal_rank_tokens``) one per distinct call key, the
    first checking the promise (:func:`~moeflow.dispatch.plan.gather_known`)."""
    return gather_known(plan, [plan.num_tokens, plan.capacity], group, size,
                        "node_dedup_padded", "their tokens and capacities")


def padded_stage(strategy, send, plan, runner, r: int) -> DedupStage:
    """The seven task functions over r chunks of consecutive tokens and their lane tasks'
    backward (collective: gathers the ranks' token counts and capacities first, unless
    ``plan`` holds them already: a checkpoint's recomputation replays the first forward's)."""
    layer = strategy.layer
    topo, cfg = layer.topo, layer.cfg
    N, L, n, l = topo.num_nodes, topo.local_size, topo.node_rank, topo.local_rank
    P, E, k, T = topo.world_size, cfg.num_experts, plan.top_k, plan.num_tokens
    El = E // P
    En = El * L
    M = send.shape[1] - k
    dev = send.device
    g = lambda node, local: node * L + local        # noqa: E731
    TC = plan.gathered_for("padded")     # a checkpoint's recomputation: the first forward's
    if TC is None:
        TC = padded_counts(plan, topo.world_group, P)      # host integers: no device read
        plan.gathered = ("padded", TC)
    Tq, Cq = TC[:, 0], TC[:, 1]
    plan.counts = np.repeat(Cq.reshape(-1, 1), E, axis=1)
    plan.ep_rank = topo.ep_rank
    ids, pos = plan.experts, plan.positions
    bounds = [(i * T) // r for i in range(r + 1)]

    def rows_to_node(q: int, i: int) -> int:      # B_q of chunk i
        t = (i + 1) * int(Tq[q]) // r - i * int(Tq[q]) // r
        return min(t, node_capacity(En, int(Cq[q]), k, plan.nodes_per_token))

    # the relay's sources are (s, l) for every node s; its fan-out block per local rank l2:
    # [source node s][local expert e][slot], C_(s,l) rows each
    Cs = [int(Cq[g(s, l)]) for s in range(N)]
    base = np.cumsum([0] + [El * c for c in Cs])[:-1]
    blk = El * sum(Cs)
    # what this rank receives from relay l1: [s][e][slot], C_(s,l1) rows each
    sizes = [int(Cq[g(s, l1)]) for l1 in range(L) for s in range(N) for _ in range(El)]
    to_experts = [(l1 * N + s) * El + e for e in range(El) for l1 in range(L)
                  for s in range(N)]
    back_order = np.argsort(to_experts, kind="stable").tolist()
    counts = [sum(int(Cq[g(s, l1)]) for l1 in range(L) for s in range(N))] * El
    # rows this rank receives from each relay l1 of its node: its experts' blocks of every source
    from_relays = [El * sum(int(Cq[g(s, l1)]) for s in range(N)) for l1 in range(L)]
    inter, intra = topo.inter_node_group, topo.intra_node_group
    remote_a, other_b = [m != n for m in range(N)], [j != l for j in range(L)]
    counter = strategy.intra_node_bytes      # bytes to the other ranks of this node
    grad_on = torch.is_grad_enabled()
    state: dict[int, tuple] = {}

    def hop(i: int) -> Hop:
        send_a = [rows_to_node(g(n, l), i)] * N
        recv_a = [rows_to_node(g(s, l), i) for s in range(N)]
        return Hop(send_a, recv_a, inter, remote_a, runner.inter_node_bytes, runner.codec,
                   runner.backward_codec, runner.nonfinite)

    def c1(i, src):
        lo, hi = bounds[i], bounds[i + 1]
        t, B = hi - lo, rows_to_node(g(n, l), i)
        ids_i = ids[lo:hi]
        hit = token_nodes(ids_i, En, N)                 # dropped choices reach no node
        node = torch.arange(N, device=dev) * B
        dst = torch.where(hit, node + torch.cumsum(hit.long(), 0) - 1, N * B)   # (t, N)
        dst = dst.t().reshape(-1)
        rows = (send[lo:hi] if src is None else src).repeat(N, 1)
        meta = torch.cat([ids_i, pos[lo:hi]], 1).to(torch.int32).repeat(N, 1)
        buf = rows.new_zeros(N * B + 1, rows.shape[1]).index_copy(0, dst, rows)[:N * B]
        fill = meta.new_full((N * B + 1, 2 * k), E)
        meta = fill.index_copy(0, dst, meta)[:N * B]
        state[i] = (dst, t)
        return (buf[:, :M], buf[:, M:], meta), buf.numel()

    def a1(i, p):
        with torch.set_grad_enabled(grad_on):        # grad mode is per thread
            h = hop(i)
            x_r, gate_r, meta_r = CodedAllToAll.apply(h, *p)
            meta_r = meta_r.long()
            ids_r, slot_r = meta_r[:, :k], meta_r[:, k:]
            R = x_r.shape[0]
            src = np.repeat(np.arange(N), h.recv)               # source node of each row
            src = to_device_async(src, dev)
            on = (ids_r // En) == n
            le = torch.where(on, ids_r - n * En, 0)
            at = ((le // El) * blk + to_device_async(base, dev).index_select(0, src)[:, None]
                  + (le % El) * to_device_async(Cs, dev).index_select(0, src)[:, None]
                  + slot_r)
            at = torch.where(on, at, L * blk).reshape(-1)
            rows = x_r.unsqueeze(1).expand(R, k, M).reshape(R * k, M)
            fan = rows.new_zeros(L * blk + 1, M).index_copy(0, at, rows)[:L * blk]
            if L > 1:
                fan = AllToAll.apply(fan, [blk] * L,
                                     from_relays, intra, other_b, counter)
        state[i] += (gate_r, on, at, R)
        return fan, x_r.numel() * x_r.element_size()

    def d1(i, fan):
        return take_in_graph(fan, sizes, to_experts), fan.numel()

    def experts(i, grouped):
        out = runner.experts(grouped, counts)
        if not any(counts):          # no slots anywhere: keep the way back in the graph
            out = out.new_zeros(0, out.shape[1]) + grouped.sum() * 0
        return out, grouped.numel()

    def c2(i, out):
        back_sizes = [sizes[j] for j in to_experts]
        return take_in_graph(out, back_sizes, back_order), out.numel()

    def a2(i, out):
        _, _, gate_r, on, at, R = state[i][:6]
        with torch.set_grad_enabled(grad_on):
            if L > 1:
                out = AllToAll.apply(out, from_relays, [blk] * L, intra, other_b,
                                     counter)
            full = torch.cat([out, out.new_zeros(1, out.shape[1])]).index_select(0, at)
            gates = (gate_r * on.to(gate_r.dtype)).to(full.dtype)
            partial = (full.view(R, k, full.shape[1]) * gates.unsqueeze(-1)).sum(1)
            (back,) = CodedAllToAll.apply(hop(i).reversed(), partial)
        state[i] += (full, gates)           # what the scheduled backward's a2_back needs
        return back, partial.numel() * partial.element_size()

    def d2(i, back):
        dst, t = state[i][:2]
        y = torch.cat([back, back.new_zeros(1, back.shape[1])]).index_select(0, dst)
        return y.view(N, t, y.shape[1]).sum(0), back.numel()

    # the backward of the lane tasks, mirrored (on the lane: explicit, no autograd)
    def a1_back(i, g_fan, g_gate):
        gate_r, on, at, R = state[i][2:6]
        if L > 1:
            g_fan = exchange_rows(g_fan, from_relays, [blk] * L, intra, other_b,
                                  counter)
        g_rows = torch.cat([g_fan, g_fan.new_zeros(1, M)]).index_select(0, at)
        g_x = g_rows.view(R, k, M).sum(1)
        g_x, g_gates = hop_backward(hop(i), g_x, [g_gate])      # once per (token, node)
        return (g_x, g_gates), g_x.numel() * g_x.element_size()

    def a2_back(i, g_back):
        gate_r, on, at, R, full, gates = state[i][2:]
        (g_partial,) = hop_backward(hop(i).reversed(), g_back, [])
        g_full, g_gate = gated_sum_backward(full, gates, on, g_partial, gate_r.dtype)
        g_out = g_full.new_zeros(L * blk + 1, M).index_add_(0, at, g_full)[:L * blk]
        if L > 1:
            g_out = exchange_rows(g_out, [blk] * L,
                                  from_relays, intra, other_b, counter)
        return (g_out, g_gate), g_back.numel() * g_back.element_size()

    return DedupStage(Stage({"C1": c1, "A1": a1, "D1": d1, "E": experts, "C2": c2, "A2": a2,
                             "D2": d2}), a1_back, a2_back)
