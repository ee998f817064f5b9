"""The relay's overlapped hops (:mod:`moeflow.strategies.node_dedup.relay_overlap`) against the
one-shot exchange they replace, on random routings (importable by spawned ranks): the rows,
their order, the sums and the bytes counted must be the same, bit for bit, in both directions
(the forward's dispatch and combine, and their backward's mirrors)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow import Topology
from moeflow.bench.syncs import counting
from moeflow.comm.alltoall.phases import token_nodes
from moeflow.comm.codecs import CODECS
from moeflow.strategies.node_dedup.relay_overlap import overlapped_combine, overlapped_dispatch
from moeflow.strategies.node_dedup.steps import (AllToAll, CodedAllToAll, Hop, exchange_rows,
                                                 hop_backward)
from moeflow.strategies.node_dedup.trimmed import RankLayout, _selected, relay_rows

EL, K, COLS = 2, 2, 5          # experts per rank, choices per token, row width


def _routing(topo, seed: int, tokens: int):
    """This rank's (token, node) pair rows' expert ids, destination-node-major, and the
    chunk's layout from every rank's counts (choices per expert are not needed: zeros)."""
    N, L, P = topo.num_nodes, topo.local_size, topo.world_size
    E, En = EL * P, EL * L
    gen = torch.Generator().manual_seed(seed * 100 + topo.rank)
    ids = torch.randint(0, E, (tokens, K), generator=gen)
    hit = token_nodes(ids, En, N)
    counts = torch.cat([torch.zeros(E, dtype=torch.long), hit.sum(0),
                        token_nodes(ids, EL, P).sum(0)])
    every = [torch.zeros_like(counts) for _ in range(P)]
    dist.all_gather(every, counts)
    lay = RankLayout.build(torch.stack(every).numpy(), 0, tokens, topo, EL, E)
    _, tok = _selected(hit, lay.n_pairs, tokens)
    return ids.index_select(0, tok).to(torch.int32), lay, gen


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def overlap_worker(seeds: list[int], codec: str, dtype: str, empty_rank: bool) -> dict:
    """Per seed, whether the overlapped hops equal the one-shot ones: ``dispatch`` (rows
    received and forwarded), ``combine`` (rows back home), ``back_combine`` /
    ``back_dispatch`` (the backward's mirrors, through the backward codec), ``counters``
    (inter-node, non-finite and intra-node counts); ``crossed``: inter-node bytes; ``syncs``: the
    overlapped hops' would-be host synchronisations (none allowed). With
    ``empty_rank`` some ranks have no tokens in some seeds."""
    topo = Topology.from_env(local_size=2)
    N, L, n, l = topo.num_nodes, topo.local_size, topo.node_rank, topo.local_rank
    En = EL * L
    dt = getattr(torch, dtype)
    out = {}
    for seed in seeds:
        tokens = 3 + (seed * 7 + topo.rank) % 9
        if empty_rank and (seed + topo.rank) % 5 == 0:
            tokens = 0          # (the one-shot reference packs no empty int8 payload)
        ids32, lay, gen = _routing(topo, seed, tokens)
        x = torch.randn(ids32.shape[0], COLS, generator=gen).to(dt)
        gates = torch.rand(ids32.shape[0], K, generator=gen).to(dt)
        part = torch.randn(sum(lay.recv_b), COLS, generator=gen).to(dt)
        g_gate = torch.randn(sum(lay.recv_b), K, generator=gen).to(dt)
        g_back = torch.randn(lay.n_pairs, COLS, generator=gen).to(dt)

        def hops(counters):
            inter = Hop(lay.send_a, lay.recv_a, topo.inter_node_group,
                        [m != n for m in range(N)], counters[0], CODECS[codec](),
                        CODECS[codec](), counters[1])
            fan = Hop(lay.send_b, lay.recv_b, topo.intra_node_group,
                      [j != l for j in range(L)], counters[2], CODECS["none"](),
                      CODECS["none"](), None)
            return inter, fan

        def rows(ids_r, count):
            return relay_rows(ids_r, count, En, EL, n, L)

        # the one-shot exchange (as trimmed.py ran it before the overlap)
        ones = [torch.zeros((), dtype=torch.long) for _ in range(3)]
        inter, fan = hops(ones)
        x_r, g_r, i_r = CodedAllToAll.apply(inter, x, gates, ids32)
        row_b = rows(i_r.long(), sum(lay.send_b))
        fwd = CodedAllToAll.apply(fan, *(t.index_select(0, row_b) for t in (x_r, g_r, i_r)))
        got = AllToAll.apply(part, lay.recv_b, lay.send_b, fan.group, fan.remote, fan.counter)
        partial = got.new_zeros(x_r.shape[0], COLS).index_add(0, row_b, got)
        (back,) = CodedAllToAll.apply(inter.reversed(), partial)
        g_xb, g_gb = hop_backward(fan, part, [g_gate])
        g_x = g_xb.new_zeros(x_r.shape[0], COLS).index_add_(0, row_b, g_xb)
        g_g = g_gb.new_zeros(x_r.shape[0], K).index_add_(0, row_b, g_gb)
        back_combine = hop_backward(inter, g_x, [g_g])
        (g_partial,) = hop_backward(inter.reversed(), g_back, [])
        back_dispatch = exchange_rows(g_partial.index_select(0, row_b), lay.send_b, lay.recv_b,
                                      fan.group, fan.remote, fan.counter)

        laps = [torch.zeros((), dtype=torch.long) for _ in range(3)]
        inter2, fan2 = hops(laps)
        with counting() as syncs:          # no device value read on the host
            received, forwarded, sels = overlapped_dispatch(
                inter2, inter2.codec, fan2, lay.by_source, n, N, L, x, [gates, ids32],
                lambda s, got: rows(got[2].long(), sum(lay.by_source.send_b[s])))
            combined = overlapped_combine(inter2, inter2.codec, fan2, lay.by_source, n, N, L,
                                          [part], sels)
            back_combine2 = overlapped_combine(inter2, inter2.backward_codec, fan2,
                                               lay.by_source, n, N, L, [part, g_gate], sels)
            _, back_dispatch2, _ = overlapped_dispatch(
                inter2, inter2.backward_codec, fan2, lay.by_source, n, N, L, g_back, [],
                lambda s, got: sels[s])
        out[seed] = dict(
            dispatch=_same([x_r, g_r, i_r], received) and _same(list(fwd), forwarded),
            combine=_same([back], combined),
            back_combine=_same(list(back_combine), back_combine2),
            back_dispatch=_same([back_dispatch], back_dispatch2[:1]),
            counters=([int(c) for c in ones], [int(c) for c in laps]),
            crossed=int(laps[0]), syncs=dict(syncs.counts))
    return out
