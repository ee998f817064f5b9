"""Hierarchical all-to-alls in the step simulator (moeflow.simulate.exchange_model): their phases carry
the rows the library's algorithms send (checked against each algorithm's own count of the rows it
puts on inter-node links, no ranks started), run on their link class's fit, in order, one
collective per group, and with a lane per link class the phases of successive all-to-alls
overlap; Pipe-A2A's two streams carry what the library's pipe issues and run at once."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from moeflow.comm.alltoall.bilevel import BiLevelAllToAll
from moeflow.comm.alltoall.hier1d import Hier1DAllToAll
from moeflow.comm.alltoall import pipe as pipe_module
from moeflow.comm.alltoall.hier2d import Hier2DAllToAll
from moeflow.comm.alltoall.phases import bilevel_phases, hier1d_phases, hier2d_phases
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.simulate import CostModel, LayerSpec, simulate_layer
from moeflow.simulate.costs import KINDS
from moeflow.comm.alltoall.phases import token_nodes
from moeflow.simulate.exchange_model import exchange_steps, node_dedup_chunks
from moeflow.simulate.loads import sample_routing, zipf_popularity
from moeflow.topology import Topology

ALGOS = {"hier2d": (Hier2DAllToAll, hier2d_phases), "bilevel": (BiLevelAllToAll, bilevel_phases),
         "hier1d": (Hier1DAllToAll, hier1d_phases)}


def _costs(intra=(1e-4, 1e-8), inter=(1e-3, 1e-7), world=(1e-3, 1e-7)) -> CostModel:
    links = {}
    for cls, ab in (("intra", intra), ("inter", inter), ("world", world)):
        links[(cls, "all_to_all")] = AlphaBeta(*ab)
        links[(cls, "all_gather")] = AlphaBeta(*ab)
    return CostModel({k: AlphaBeta(1e-6, 1e-10) for k in KINDS}, links)


def _spec(**kw) -> LayerSpec:
    base = dict(tokens=256, d_model=16, d_expert=32, num_experts=8, top_k=2,
                capacity_factor=None, nodes=2, ranks_per_node=2)
    return LayerSpec(**{**base, **kw})


@pytest.mark.parametrize("N,L", [(2, 2), (2, 3), (3, 2), (4, 1)])
@pytest.mark.parametrize("name", list(ALGOS))
def test_phases_cross_what_the_algorithm_counts(name, N, L):
    """Each rank's inter-node phase sends to other nodes exactly the rows the algorithm's own
    inter_node_rows counts (its stats["inter_node_bytes"]), for dispatch and combine; every
    rank ends with its column of the matrix."""
    cls, phases = ALGOS[name]
    P = N * L
    S = np.random.default_rng(N * 10 + L).integers(0, 9, size=(P, P)).tolist()
    for combine in (False, True):
        for r in range(P):
            algo = cls(Topology(rank=r, world_size=P, local_size=L, ep_size=P))
            n, l = divmod(r, L)
            got = (phases(S, N, L, n, l, combine) if name == "bilevel"
                   else phases(S, N, L, n, l))
            inter = [ph for ph in got if ph.link == "inter"]
            assert len(inter) == 1
            assert inter[0].remote_rows(n) == algo.inter_node_rows(S[r], S, combine), (r, combine)
            assert sum(got[-1].recv) == sum(S[s][r] for s in range(P))
            assert sum(got[0].send) == sum(S[r]) or (name == "hier1d")
        # what every rank sends in one phase, some rank receives
        for j in range(len(got)):
            all_ph = [(phases(S, N, L, *divmod(r, L), combine) if name == "bilevel"
                       else phases(S, N, L, *divmod(r, L)))[j] for r in range(P)]
            assert sum(sum(ph.send) for ph in all_ph) == sum(sum(ph.recv) for ph in all_ph)


def test_hier2d_step_is_direct_with_two_phases():
    """Sequential, r = 1, uniform counts: every exchange of 2 x 2 ranks moves a rank's whole
    buffer intra-node, then inter-node; the step is direct's with the world fit replaced by
    the two phase fits, for the 4 all-to-alls of forward + backward."""
    c = _costs()
    direct = simulate_layer(_spec(), c)
    hier = simulate_layer(_spec(a2a="hier2d"), c)
    buf = 256 * 2 * 16 * 4                  # a rank's T k rows of d_model fp32
    assert direct["a2a_bytes"]["A1^1"] == [buf] * 4
    one = (c.link("intra", "all_to_all").predict(buf) + c.link("inter", "all_to_all").predict(buf)
           - c.link("world", "all_to_all").predict(buf))
    assert hier["step_s"] - direct["step_s"] == pytest.approx(4 * one, rel=1e-9)
    a1 = [t for t in hier["tasks"] if t["task"] == "A1^1" and t["rank"] == 0
          and t["phase"] == "forward"]
    assert [t["stage"] for t in a1] == ["intra", "inter"]
    assert a1[0]["end_s"] <= a1[1]["start_s"]
    # hier2d relays, but the node as a whole sends what direct sends across
    assert sum(hier["inter_node_bytes"]) == sum(direct["inter_node_bytes"]) > 0


def test_bilevel_dispatch_starts_inter_and_combines_as_hier2d():
    sim = simulate_layer(_spec(a2a="bilevel"), _costs())
    stages = lambda name: [t["stage"] for t in sim["tasks"]             # noqa: E731
                           if t["task"] == name and t["rank"] == 3 and t["phase"] == "forward"]
    assert stages("A1^1") == ["inter", "intra"] and stages("A2^1") == ["intra", "inter"]


def test_hier1d_leaders_alone_cross():
    sim = simulate_layer(_spec(a2a="hier1d"), _costs())
    leaders = [sim["inter_node_bytes"][p] for p in (0, 2)]
    assert sim["inter_node_bytes"][1] == sim["inter_node_bytes"][3] == 0 < min(leaders)
    inter = {t["rank"] for t in sim["tasks"] if t.get("stage") == "inter"}
    assert inter == {0, 2}


@pytest.mark.parametrize("algo", ["hier2d", "bilevel", "hier1d", "node_dedup"])
def test_thread_lane_orders_and_collectives(algo):
    """One communication thread (the library): a rank's collectives never overlap and run in
    issue order; the members of a phase's group start and end it together; a phase starts
    after the one before it."""
    sim = simulate_layer(_spec(a2a=algo, schedule="pipelined", pipeline_degree=2),
                         _costs(), sample_routing(zipf_popularity(8, 1.0), 4, 256, 2))
    lane = [t for t in sim["tasks"] if t["lane"] == "comm" and t["task"] != "counts"]
    for p in range(4):          # the thread's tasks (node_dedup's relay work too) in order
        mine = sorted((t for t in lane if t["rank"] == p), key=lambda t: t["start_s"])
        assert all(a["end_s"] <= b["start_s"] + 1e-15 for a, b in zip(mine, mine[1:]))
    comm = [t for t in lane if "collective" in t]
    for p in range(4):
        mine = sorted((t for t in comm if t["rank"] == p), key=lambda t: t["start_s"])
        assert all(a["end_s"] <= b["start_s"] + 1e-15 for a, b in zip(mine, mine[1:]))
    groups: dict = {}
    for t in comm:
        groups.setdefault(t["collective"], []).append(t)
    for key, ts in groups.items():       # a node's 2 ranks, or the 2 ranks of a local rank
        assert len(ts) == 2, key
        assert len({t["start_s"] for t in ts}) == len({t["end_s"] for t in ts}) == 1, key
    # a phase starts after the one before it, on every rank
    for p in range(4):
        for name in ("A1^1", "A2^1"):
            steps = [t for t in comm if t["rank"] == p and t["task"] == name
                     and t["phase"] == "backward"]
            assert len(steps) >= 2 or algo == "hier1d"
            assert all(a["end_s"] <= b["start_s"] for a, b in zip(steps, steps[1:]))


def test_link_lanes_overlap_phases_of_successive_all_to_alls():
    """A lane per link class: chunk 2's intra phase may run while chunk 1's inter phase does,
    so the step is never longer than with one thread, and shorter when communication
    dominates."""
    kw = dict(a2a="hier2d", schedule="pipelined", pipeline_degree=4, tokens=2048)
    c = _costs(intra=(1e-4, 1e-7), inter=(1e-4, 1e-7))
    thread = simulate_layer(_spec(**kw), c)
    link = simulate_layer(_spec(**kw, comm_lanes="link"), c)
    assert link["step_s"] < thread["step_s"]
    a1 = {(t["task"], t["stage"]): t for t in link["tasks"]
          if t["rank"] == 0 and t["phase"] == "forward" and t["task"].startswith("A1")}
    assert a1[("A1^2", "intra")]["start_s"] < a1[("A1^1", "inter")]["end_s"]
    # each all-to-all's own phases stay in order
    for i in range(1, 5):
        assert a1[(f"A1^{i}", "intra")]["end_s"] <= a1[(f"A1^{i}", "inter")]["start_s"]


def _pairs(spec, routing) -> list[np.ndarray]:
    """Per chunk, each rank's (token, node) pairs, from the chunk's own tokens (the library's
    consecutive cut)."""
    T, r, En = spec.tokens, spec.pipeline_degree, spec.num_experts // spec.nodes
    b = [(i * T) // r for i in range(r + 1)]
    return [np.array([int(token_nodes(torch.as_tensor(ids)[b[i]:b[i + 1]], En, 2).sum())
                      for ids in routing]) for i in range(r)]


def _relayed(spec, routing) -> list[np.ndarray]:
    """Per chunk, the pairs each rank relays (received from the ranks of its local rank)."""
    out = []
    for NE, C in node_dedup_chunks(spec, routing):
        L = spec.ranks_per_node
        out.append(np.array([sum(int(C[m * L + p % L][p // L]) for m in range(spec.nodes))
                             for p in range(spec.world)]))
    return out


def test_node_dedup_crosses_once_per_token_and_node():
    """Top-2 over 2 nodes: a token whose two experts share a node crosses once, so fewer
    bytes cross than with hier2d (every choice); the inter-node dispatch carries the token
    with its k gates and its k ids (int32) in one buffer (one collective); the backward has
    no ids, and the tokens' gradients cross back with their gates'."""
    routing = sample_routing(zipf_popularity(8, 0.0), 4, 256, 2, seed=1)
    spec = _spec(a2a="node_dedup")
    dedup = simulate_layer(spec, _costs(), routing)
    hier = simulate_layer(_spec(a2a="hier2d"), _costs(), routing)
    assert 0 < sum(dedup["inter_node_bytes"]) < sum(hier["inter_node_bytes"])
    b = dedup["step_bytes"]
    (pairs,), (relayed,) = _pairs(spec, routing), _relayed(spec, routing)
    assert (np.array(b["forward/A1^1/inter"]) == pairs * (16 * 4 + 2 * 4 + 2 * 4)).all()
    assert (np.array(b["forward/A2^1/inter"]) == relayed * 16 * 4).all()
    assert (np.array(b["backward/A1^1/inter"]) == pairs * 16 * 4).all()
    assert (np.array(b["backward/A2^1/inter"]) == relayed * (16 + 2) * 4).all()
    assert not any("ids" in k for k in b)
    # each rank's pairs: its tokens' distinct nodes (both nodes, or one)
    assert all(256 <= n <= 2 * 256 for n in pairs)


def test_node_dedup_chunks_are_whole_exchanges_on_the_lane():
    """r = 2: each chunk is a deduplicated exchange of its own consecutive tokens (its pairs
    cross, in sum what r = 1 sends); the hops are communication-lane tasks that OptSche
    overlaps with the other chunk's computing tasks; the count exchange runs once, every
    chunk's counts (E choices, N pairs) in one all-gather, on the computing lane."""
    routing = sample_routing(zipf_popularity(8, 1.0), 4, 256, 2, seed=2)
    one = simulate_layer(_spec(a2a="node_dedup"), _costs(), routing)
    spec = _spec(a2a="node_dedup", pipeline_degree=2, schedule="optsche")
    sim = simulate_layer(spec, _costs(), routing)
    b = sim["step_bytes"]
    for i, pairs in enumerate(_pairs(spec, routing)):
        assert (np.array(b[f"forward/A1^{i + 1}/inter"]) == pairs * (16 + 2 + 2) * 4).all()
    assert sim["inter_node_bytes"] == one["inter_node_bytes"]
    counts = [t for t in sim["tasks"] if t["task"] == "counts"]
    assert len(counts) == 4 and {t["size"] for t in counts} == {4 * 2 * (8 + 2) * 8}
    tasks = [t for t in sim["tasks"] if t["rank"] == 0 and t["phase"] == "forward"]
    hop = next(t for t in tasks if t["task"] == "A1^2" and t.get("stage") == "inter")
    assert any(t["lane"] == "compute" and t["task"].startswith(("D1^1", "E^1"))
               and t["start_s"] < hop["end_s"] and hop["start_s"] < t["end_s"] for t in tasks)
    back = [t for t in sim["tasks"] if t["phase"] == "backward" and t["lane"] == "comm"
            and t.get("stage") == "inter"]
    assert {t["task"] for t in back} == {"A1^1", "A1^2", "A2^1", "A2^2"}
    # the same tasks one after another on the computing thread take longer
    seq = simulate_layer(replace(spec, schedule="sequential"), _costs(), routing)
    assert sim["step_s"] < seq["step_s"]


def test_node_dedup_codec_on_the_inter_node_hops_only():
    """A codec encodes what crosses nodes (one encoding per (token, node) or partial sum):
    the inter-node hops carry its wire bytes with the gates and ids raw, the fan-out inside the
    node raw rows; encode and decode run in the lane task, not in C / D; codec_backward
    compresses the backward's hops too."""
    routing = sample_routing(zipf_popularity(8, 1.0), 4, 256, 2, seed=3)
    costs = _costs()
    costs.compute["codec:fp16"] = AlphaBeta(1e-5, 1e-9)
    plain = simulate_layer(_spec(a2a="node_dedup"), costs, routing)
    for codec_backward in (False, True):
        spec = _spec(a2a="node_dedup", codec="fp16", codec_backward=codec_backward)
        sim = simulate_layer(spec, costs, routing)
        b, p = sim["step_bytes"], plain["step_bytes"]
        (pairs,), (relayed,) = _pairs(spec, routing), _relayed(spec, routing)
        assert (np.array(b["forward/A1^1/inter"]) == pairs * (16 * 2 + 2 * 4 + 2 * 4)).all()
        assert (np.array(b["forward/A2^1/inter"]) == relayed * 16 * 2).all()
        for key in ("forward/A1^1/intra", "forward/A2^1/intra", "backward/A1^1/intra"):
            assert b[key] == p[key]
        e = 2 if codec_backward else 4
        assert (np.array(b["backward/A1^1/inter"]) == pairs * 16 * e).all()
        assert (np.array(b["backward/A2^1/inter"]) == relayed * (16 * e + 2 * 4)).all()
        lane = [t for t in sim["tasks"] if t["rank"] == 0 and t["task"] == "A1^1"
                and t["phase"] == "forward"]
        # encode, the hop, decode, the relay's fan-out, the intra-node step
        assert [t.get("stage") for t in lane] == [None, "inter", None, None, "intra"]
        assert lane[0]["end_s"] - lane[0]["start_s"] == pytest.approx(
            0.5 * (1e-5 + 1e-9 * pairs[0] * 16 * 4))
        for name in ("C1^1", "D2^1"):       # no codec time in the computing tasks
            t = [x for x in sim["tasks"] if x["rank"] == 0 and x["task"] == name]
            u = [x for x in plain["tasks"] if x["rank"] == 0 and x["task"] == name]
            assert [x["end_s"] - x["start_s"] for x in t] == \
                pytest.approx([x["end_s"] - x["start_s"] for x in u])


class _Work:
    def wait(self) -> None:
        pass


@pytest.mark.parametrize("N,L", [(2, 2), (2, 3), (3, 2), (4, 1)])
def test_pipe_steps_carry_what_the_library_issues(N, L, monkeypatch):
    """Each rank's two pipe steps send what PipeAllToAll.start puts in its two
    all_to_all_single calls (recorded, no ranks started): the Intra-Stream over the node's
    group, the Inter-Stream over the lane group with the node's blocks zeroed; the Inter-Stream
    puts on inter-node links exactly the bytes the library counts (inter_node_rows), and is
    issued with the Intra-Stream (concurrent), over the world."""
    P, row = N * L, 3 * 8
    S = np.random.default_rng(N * 10 + L).integers(0, 9, size=(P, P))
    spec = _spec(nodes=N, ranks_per_node=L, a2a="pipe", num_experts=P * 2, d_model=3,
                 dtype="fp64")
    steps = exchange_steps(spec, _costs(), S, combine=False, row_bytes=row)
    for r in range(P):
        calls = []

        def record(out, x, out_splits, in_splits, group=None, async_op=False):
            calls.append((group, list(in_splits), list(out_splits)))
            return _Work()
        monkeypatch.setattr(pipe_module.dist, "all_to_all_single", record)
        topo = Topology(rank=r, world_size=P, local_size=L, ep_size=P,
                        intra_node_group="node", lane_group="lane")
        algo = pipe_module.PipeAllToAll(topo)
        send, recv = S[r].tolist(), S[:, r].tolist()
        algo.start(torch.zeros(sum(send), 3, dtype=torch.float64), send, recv).wait()
        mine = steps[r]
        assert [c[0] for c in calls] == (["node"] if L > 1 else []) + ["lane"]
        assert [st.stage for st in mine] == [c[0].replace("node", "intra").replace(
            "lane", "inter") for c in calls]
        assert [st.nbytes for st in mine] == [sum(c[1]) * row for c in calls]
        assert [st.concurrent for st in mine] == [False] + [True] * (L > 1)
        n = r // L
        lane_send = calls[-1][1]
        crossing = sum(rows for j, rows in enumerate(lane_send) if j // L != n)
        assert crossing == sum(lane_send) == algo.inter_node_rows(send, None)
        assert mine[-1].remote_bytes == crossing * row > 0
        assert mine[-1].group.endswith("/world") and mine[-1].link == "inter"
        # the two calls receive this rank's column between them (L = 1: its own block is
        # kept without a collective)
        assert sum(sum(c[2]) for c in calls) + (recv[r] if L == 1 else 0) == sum(recv)


def test_pipe_streams_start_together_and_the_thread_waits_for_both():
    """One communication thread: the thread issues the Intra- and the Inter-Stream together,
    the consumer D and the thread's next all-to-all start when both have ended; with a lane per
    link class the two streams run on the intra and inter lanes."""
    sim = simulate_layer(_spec(a2a="pipe", schedule="pipelined", pipeline_degree=2),
                         _costs(intra=(1e-4, 1e-8), inter=(1e-3, 1e-7)))
    mine = [t for t in sim["tasks"] if t["rank"] == 0 and t["phase"] == "forward"]
    by = {(t["task"], t.get("stage")): t for t in mine}
    intra, inter = by[("A1^1", "intra")], by[("A1^1", "inter")]
    assert [t["stage"] for t in mine if t["task"] == "A1^1"] == ["intra", "inter"]
    assert intra["start_s"] == inter["start_s"] and intra["end_s"] < inter["end_s"]
    assert inter["collective"].endswith("/world")
    assert by[("D1^1", None)]["start_s"] >= inter["end_s"]
    assert by[("A1^2", "intra")]["start_s"] >= inter["end_s"]
    link = simulate_layer(_spec(a2a="pipe", schedule="pipelined", pipeline_degree=2,
                                comm_lanes="link"), _costs(intra=(1e-4, 1e-8), inter=(1e-3, 1e-7)))
    assert link["step_s"] <= sim["step_s"] + 1e-12
    # the union of the communication tasks, not their sum
    assert sim["comm_s"] < sum(sim["busy_s"][k] for k in ("counts", "A1", "A2"))


@pytest.mark.parametrize("slow", ["intra", "world"])
def test_pipe_step_is_the_max_of_its_streams(slow):
    """Sequential, r = 1, uniform counts on 2 x 2: the Intra-Stream moves half a rank's buffer
    (its node's two blocks), the Inter-Stream the other half, timed by the world fit at the
    buffer that loads the node's link as much (twice its size: a world buffer puts half of
    itself across). Each of the 4 all-to-alls takes the longer of the two (Eq. 16), not their
    sum (Eq. 17), whichever fit dominates."""
    fast, heavy = (1e-4, 1e-8), (1e-3, 1e-6)
    c = _costs(intra=heavy if slow == "intra" else fast, inter=fast,
               world=heavy if slow == "world" else fast)
    direct = simulate_layer(_spec(), c)
    pipe = simulate_layer(_spec(a2a="pipe"), c)
    buf = 256 * 2 * 16 * 4
    t_intra = c.link("intra", "all_to_all").predict(buf / 2)
    t_inter = c.link("world", "all_to_all").predict(buf / 2 * 4 / 2)
    assert t_inter == c.link("world", "all_to_all").predict(buf)      # direct's collective
    one = max(t_intra, t_inter) - c.link("world", "all_to_all").predict(buf)
    assert pipe["step_s"] - direct["step_s"] == pytest.approx(4 * one, rel=1e-9, abs=1e-12)
    summed = direct["step_s"] + 4 * (t_intra + t_inter - c.link("world", "all_to_all")
                                     .predict(buf))           # the two streams in order
    assert summed - pipe["step_s"] == pytest.approx(4 * min(t_intra, t_inter), rel=1e-9)
    assert pipe["inter_node_bytes"] == direct["inter_node_bytes"]


def test_link_lanes_run_one_hop_all_to_alls():
    """With a lane per link class a one-hop all-to-all over the world runs on a lane of its
    own (its link class "world"), as long as with one thread at r = 1."""
    c = _costs()
    thread = simulate_layer(_spec(), c)
    link = simulate_layer(_spec(comm_lanes="link"), c)
    assert link["step_s"] == pytest.approx(thread["step_s"], rel=1e-12)
