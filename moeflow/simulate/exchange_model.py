"""The collectives of one simulated all-to-all: per rank, its steps, their link and their bytes.

``direct`` is one collective over the EP group, ``pairwise`` P-1 rounds of p2p (ScheMoE
Eq. 15). The hierarchical exchanges are their phases, each an all-to-all over the ranks of one
node (link class ``intra``) or over the ranks of equal local rank (``inter``), with the split
sizes the algorithms themselves use (:mod:`moeflow.comm.alltoall.phases`): ``hier2d`` (intra then
inter), ``bilevel`` (inter then intra; its combine as hier2d), ``hier1d`` (gather to the leader,
inter among leaders, scatter) and ``node_dedup`` (one row per (token, node) across nodes: the
token through the pass's codec with its k gates and its k expert ids (int32) raw in the same
buffer, :func:`moeflow.strategies.node_dedup.steps._coded`; then one raw row per choice inside
the node; the combine and the backward the mirror, without the ids). A phase over one rank per
node (L = 1) skips its intra step, as the algorithms do. node_dedup's lane tasks also hold the
work the library does on the communication thread around the collectives (``local`` steps):
the codec's encode before the inter-node hop and its decode after it, and the relay's fan-out
index arithmetic or gated partial sum (:mod:`moeflow.strategies.node_dedup.strategy`, ``a1`` / ``a2``).

``pipe`` (ScheMoE Section 5, Fig. 7) is two collectives issued together, not in order
(:func:`~moeflow.comm.alltoall.phases.pipe_phases`): the Intra-Stream, an all-to-all over the node's
ranks on the ``intra`` fit, and the Inter-Stream, an all-to-all over the whole world (the
topology's ``lane_group``) with the node's own blocks zeroed, marked ``concurrent``: the layer
model starts it beside the intra step and ends the exchange when both have ended, Eq. 16's
``max(M t1, (P - M) t2)`` (:mod:`.layer` places the two).

A phase's time is the link fit of its class at the largest buffer (sent or received) of its
group's members: a collective ends with its slowest member (Parm Section IV's ``alpha + beta *
volume``; the fits of ``moeflow bench links`` run every group of a class at once, so an
inter-node phase's fit already shares the node's link among its local ranks). Pipe's
Inter-Stream is a collective over the world group, so it takes the fit the world group was
measured with (``world``; ``inter`` where a node has one rank, the world being that group), at
its buffer scaled by ``W / (W - L)``: that fit's buffer (nccl-tests convention, a uniform
all-to-all) puts ``(W - L) / W`` of its bytes on inter-node links, the Inter-Stream's buffer
all of them, so a fit buffer of ``W / (W - L)`` times its size loads the node's link as much.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeflow.dispatch.capacity import capacity
from moeflow.comm.alltoall.phases import (INTER, INTRA, Phase, bilevel_phases, hier1d_phases,
                                     hier2d_phases, kept_choices, node_dedup_phases,
                                     pipe_phases, token_nodes)
from moeflow.dispatch.plan import make_plan
from moeflow.simulate.costs import CostModel

HIERARCHICAL = ("hier2d", "bilevel", "hier1d", "node_dedup", "pipe")


@dataclass
class Step:
    """One collective call of one rank inside an all-to-all."""

    stage: str           # "all_to_all", "pairwise", "intra", "inter"; local: "encode",
                         # "decode", "relay"
    link: str            # link class: of the fit, and the lane with --comm-lanes link
    seconds: float       # (pipe's Inter-Stream: "inter", timed with the world fit)
    nbytes: int          # bytes of this rank's send buffer
    remote_bytes: int    # bytes of it bound for other nodes
    group: str           # the collective: "world", or "<step>/node<n>", "<step>/local<l>",
                         # "<step>/world"
    concurrent: bool = False    # issued with the step before it, both waited for (pipe)
    local: bool = False         # work of this rank's lane task, not a collective (node_dedup)


def _link_class(spec, a: int, b: int) -> str:
    return "intra" if a // spec.ranks_per_node == b // spec.ranks_per_node else "inter"


def a2a_seconds(spec, costs: CostModel, mat_bytes: np.ndarray) -> tuple[float, str]:
    """Seconds of one all-to-all whose ``mat_bytes[src][dst]`` bytes move, and its link class.

    ``direct``: one collective over the EP group, the fit of its link class at the largest
    per-rank buffer (sent or received; a collective ends with its slowest member).
    ``pairwise``: P-1 rounds of one send/recv each (ScheMoE Eq. 15), a round as long as its
    slowest pair's p2p over that pair's link class."""
    W = spec.world
    if W == 1:
        return 0.0, "self"          # a one-rank exchange is a local copy (no collective)
    if spec.a2a == "direct":
        cls = ("intra" if spec.nodes == 1 else "inter" if spec.ranks_per_node == 1
               else "world")
        per_rank = np.maximum(mat_bytes.sum(1), mat_bytes.sum(0))
        return costs.link(cls, "all_to_all").predict(float(per_rank.max())), cls
    total = 0.0
    classes = set()
    for s in range(1, W):
        rnd = 0.0
        for p in range(W):
            q = (p + s) % W
            cls = _link_class(spec, p, q)
            classes.add(cls)
            if mat_bytes[p, q]:
                rnd = max(rnd, costs.link(cls, "p2p").predict(float(mat_bytes[p, q])))
        total += rnd
    return total, "+".join(sorted(classes))


def _one_hop(spec, costs, mat_bytes: np.ndarray) -> dict[int, list[Step]]:
    """``direct`` / ``pairwise``: every block crosses once, to its destination rank."""
    W, L = spec.world, spec.ranks_per_node
    seconds, link = a2a_seconds(spec, costs, mat_bytes)
    out = {}
    for p in range(W):
        remote = sum(int(mat_bytes[p, q]) for q in range(W) if q // L != p // L)
        out[p] = [Step(spec.a2a if spec.a2a == "pairwise" else "all_to_all", link, seconds,
                       int(mat_bytes[p].sum()), remote, "world")]
    return out


def _phase_lists(spec, S: np.ndarray, combine: bool, dedup, row: int
                 ) -> dict[int, list[tuple]]:
    """Per rank, ``(Phase, row_bytes, stage)`` of one exchange of the split matrix ``S``
    (rows). ``dedup``: node_dedup's ``(NE, C, phase, codec)`` of one chunk; ``row``: bytes of
    a row through the pass's codec, which node_dedup applies on its inter-node hops only (its
    intra-node rows are raw: ``d`` elements), with its gates (and ids) raw beside them."""
    N, L, d, B = spec.nodes, spec.ranks_per_node, spec.width, spec.elem_bytes
    out = {}
    for n in range(N):
        for l in range(L):
            p = n * L + l
            if spec.a2a == "hier2d":
                out[p] = [(ph, row, ph.link) for ph in hier2d_phases(S, N, L, n, l)]
            elif spec.a2a == "bilevel":
                out[p] = [(ph, row, ph.link) for ph in bilevel_phases(S, N, L, n, l, combine)]
            elif spec.a2a == "hier1d":
                out[p] = [(ph, row, ph.link) for ph in hier1d_phases(S, N, L, n, l)]
            elif spec.a2a == "pipe":
                out[p] = [(ph, row, ph.link) for ph in pipe_phases(S[p], S[:, p], N, L, n)]
            else:
                NE, C, phase, _ = dedup
                k = spec.top_k
                inter, intra = node_dedup_phases(NE, C, N, L, spec.num_experts // spec.world,
                                                 n, l)
                back = lambda ph: Phase(ph.link, ph.recv, ph.send)    # noqa: E731
                raw = d * B                    # the fan-out and its way back: raw rows
                if phase == "forward" and not combine:        # dispatch: token, gates, ids
                    out[p] = [(inter, row + k * B + 4 * k, INTER), (intra, raw, INTRA)]
                elif phase == "forward":                      # combine: partial sums back
                    out[p] = [(back(intra), raw, INTRA), (back(inter), row, INTER)]
                elif not combine:   # backward's first exchange: the partial sums' gradients
                    out[p] = [(inter, row, INTER), (intra, raw, INTRA)]
                else:               # the gradients of the experts' inputs: tokens and gates
                    out[p] = [(back(intra), raw, INTRA), (back(inter), row + k * B, INTER)]
            if L == 1:              # a node of one rank: the algorithms skip the intra step
                out[p] = [x for x in out[p] if x[0].link != INTRA]
    return out


def exchange_steps(spec, costs, S: np.ndarray, combine: bool, phase: str = "forward",
                   dedup=None, row_bytes: int | None = None) -> dict[int, list[Step]]:
    """Per rank, the steps of one all-to-all of split matrix ``S`` (rows; ``combine``: the
    way back, as :meth:`AllToAll.start_combine`), with their times from ``costs``.
    ``row_bytes``: bytes per row on the wire (a codec's; default ``spec.width`` elements:
    ``d_model``, or BigMac's ``r * d_model``, whose DCCA exchanges the descended rows)."""
    row = spec.width * spec.elem_bytes if row_bytes is None else row_bytes
    if spec.a2a not in HIERARCHICAL:
        return _one_hop(spec, costs, S * row)
    L, W = spec.ranks_per_node, spec.world
    lists, wire = _phase_lists(spec, S, combine, dedup, row), row
    out: dict[int, list[Step]] = {p: [] for p in lists}
    for j in range(max(len(v) for v in lists.values())):
        groups: dict[str, list[tuple[int, int, int]]] = {}     # group -> (rank, send, buffer)
        for p, steps in lists.items():
            if j >= len(steps):
                continue
            ph, row, stage = steps[j]
            n, l = divmod(p, L)
            if ph.members == "leaders" and l != 0:
                continue
            key = "world" if ph.world else f"node{n}" if ph.link == INTRA else f"local{l}"
            buf = max(sum(ph.send), sum(ph.recv)) * row
            groups.setdefault(key, []).append((p, sum(ph.send) * row, buf))
        for key, members in groups.items():
            p0 = members[0][0]
            ph, row, stage = lists[p0][j]
            big = float(max(b for *_, b in members))
            if ph.world:        # pipe's Inter-Stream: the world group's fit (module docstring)
                fit = costs.link("world" if L > 1 else "inter", "all_to_all")
                seconds = fit.predict(big * W / (W - L))
            else:
                seconds = costs.link(ph.link, "all_to_all").predict(big)
            for p, nbytes, _ in members:
                ph_p = lists[p][j][0]
                me = p if ph.world else p // L if ph.link == INTER else p % L
                remote = ph_p.remote_rows(me) * row if ph.link == INTER else 0
                # pipe issues its Inter-Stream right after its Intra-Stream, async (j > 0: a
                # node of one rank has no intra step, and its inter step is the only one)
                out[p].append(Step(stage, ph.link, seconds, nbytes, remote, f"{j}/{key}",
                                   concurrent=ph.world and j > 0))
    if spec.a2a == "node_dedup":
        for p in out:
            out[p] = _dedup_lane_work(spec, costs, dedup, combine, wire, p, out[p])
    return out


def _dedup_lane_work(spec, costs, dedup, combine: bool, wire: int, p: int,
                     steps: list[Step]) -> list[Step]:
    """node_dedup's lane task of rank ``p``: its collectives with the work the library does
    between them on the communication thread (:mod:`moeflow.strategies.node_dedup.strategy`'s ``a1`` /
    ``a2`` and their explicit backward): the codec encodes what the inter-node hop sends and
    decodes what it receives (``CodedAllToAll``: one encoding per (token, node) or per partial
    sum), and the relay fans the received rows out by expert id, or forms the gated partial sum
    per received token (or their backward). The first exchange of a pass (``combine`` False)
    crosses nodes first, from the tokens' side; the second ends with the crossing back."""
    NE, C, phase, codec = dedup
    N, L, k, d, B = spec.nodes, spec.ranks_per_node, spec.top_k, spec.width, spec.elem_bytes
    n, l = divmod(p, L)
    inter, intra = node_dedup_phases(NE, C, N, L, spec.num_experts // spec.world, n, l)
    pairs, R, fan = sum(inter.send), sum(inter.recv), sum(intra.send)
    el = lambda nbytes: costs.compute_time("elementwise", nbytes)   # noqa: E731

    def local(stage: str, link: str, seconds: float) -> Step:
        return Step(stage, link, seconds, 0, 0, "", local=True)

    def coded(rows: int) -> float:
        return costs.codec_time(codec.name, rows * d * B, rows * wire)

    # the hop's sender: the tokens' side in dispatch and in the backward's first exchange
    enc, dec = (pairs, R) if not combine else (R, pairs)
    if combine == (phase == "forward"):     # the gated partial sum, or its backward: R x k rows
        relay = local("relay", "intra", el(3 * R * k * d * B))
    else:                                   # the fan-out by expert id, or its sum back
        relay = local("relay", "intra", el(2 * fan * d * B))
    hop = [st for st in steps if st.stage == INTER]
    if codec.name != "none":
        hop = ([local("encode", INTER, coded(enc))] + hop + [local("decode", INTER, coded(dec))])
    rest = [st for st in steps if st.stage != INTER]
    return hop + [relay] + rest if not combine else rest + [relay] + hop


def node_dedup_chunks(spec, routing: list) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per chunk of consecutive tokens (``pipeline_degree`` r; the library's bounds
    ``(i T) // r``), ``(NE, C)``: ``NE[p][e]`` kept choices of rank p for expert e and
    ``C[p][m]`` its tokens with a kept choice on node m (the inter-node rows of its dispatch),
    what :meth:`moeflow.strategies.node_dedup.NodeDedup._trimmed_stage` gathers per chunk in
    its one count exchange. Capacity drops are decided over the whole call, as
    :meth:`~moeflow.strategies.node_dedup.NodeDedup.plan` does, and reach no node."""
    E, N, r = spec.num_experts, spec.nodes, spec.pipeline_degree
    En = E // N
    cap = (None if spec.capacity_factor is None
           else capacity(spec.tokens, spec.top_k, E, spec.capacity_factor))
    per_rank = []
    for ids in routing:
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
        if cap is not None:
            plan = make_plan(ids, E, cap)
            ids, _ = kept_choices(ids, plan.slot, plan.send_rows, E)
        T = ids.shape[0]
        bounds = [(i * T) // r for i in range(r + 1)]
        hit = token_nodes(ids, En, N)
        rows = []
        for lo, hi in zip(bounds, bounds[1:]):
            flat = ids[lo:hi].reshape(-1)
            rows.append((flat.new_zeros(E + 1).index_add_(0, flat, torch.ones_like(flat))[:E]
                         .numpy(), hit[lo:hi].sum(0).numpy()))
        per_rank.append(rows)
    return [(np.stack([rk[i][0] for rk in per_rank]).astype(np.int64),
             np.stack([rk[i][1] for rk in per_rank]).astype(np.int64)) for i in range(r)]
