"""``layer.stats["inter_node_bytes"]``: the payload bytes a rank sent over inter-node links in
the last step (forward + backward), on 4 gloo ranks as 2 emulated nodes x 2.

Three counts must agree: the layer's, the bytes measured on the wire (every
``all_to_all_single`` of the step tallied by destination node, the count exchange excluded as
it is an ``all_gather``), and for the one-hop ``direct`` the count computed from the routing
alone (a choice crosses when its expert sits on another node; its output crosses back).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import moeflow as mf
from moeflow.dispatch import capacity
from moeflow.init import seeded_normal
from moeflow.launch import launch_local

D_MODEL, E, K = 6, 8, 2
ALGOS = ["direct", "hier2d", "bilevel", "hier1d", "pipe"]
DEDUP_R2 = dict(pipeline_degree=2, schedule="optsche", codec="int8", codec_backward=True)
MODES = {"dropless": dict(capacity_factor=None),
         "pad": dict(capacity_factor=1.0, capacity_padding="pad"),
         "trim": dict(capacity_factor=1.0, capacity_padding="trim")}


def _wire_counter(tally: list[int]):
    """Wrap ``dist.all_to_all_single``: add the bytes of every block bound for another node."""
    real = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                async_op=False):
        L = 2
        size = dist.get_world_size(group)
        splits = (list(input_split_sizes) if input_split_sizes
                  else [input.shape[0] // size] * size)
        row = input.element_size() * (input.numel() // max(1, input.shape[0]))
        me = dist.get_rank() // L
        for j, rows in enumerate(splits):
            g = j if group is None else dist.get_global_rank(group, j)
            if g // L != me:
                tally[0] += rows * row
        return real(output, input, output_split_sizes, input_split_sizes, group=group,
                    async_op=async_op)
    return real, counted


def _worker() -> dict:
    torch.set_num_threads(1)
    topo = mf.Topology.from_env(local_size=2)
    out = {}
    for mode, opts in MODES.items():
        for algo in ALGOS + (["node_dedup"] if mode != "pad" else []) + (
                ["node_dedup_r2_int8"] if mode == "dropless" else []):
            extra = {}
            if algo == "node_dedup_r2_int8":        # chunks, OptSche, a codec both ways
                extra = dict(DEDUP_R2, placement="node_dedup")
            cfg = mf.MoEConfig(d_model=D_MODEL, d_expert=5, num_experts=E, top_k=K,
                               **{**({"placement": "node_dedup"} if algo.startswith("node_dedup")
                                      else {"a2a": algo}), **opts, **extra})
            layer = mf.MoELayer(cfg, topo).double()
            T = 5 + 2 * topo.rank
            x = seeded_normal((T, D_MODEL), 1.0, "inb", topo.rank,
                              dtype=torch.float64).requires_grad_()
            tally = [0]
            real, counted = _wire_counter(tally)
            dist.all_to_all_single = counted
            try:
                layer(x).square().sum().backward()
            finally:
                dist.all_to_all_single = real
            ids = layer.router(x.detach()).experts          # the same routing, again
            out[(mode, algo)] = dict(stat=int(layer.stats["inter_node_bytes"]),
                                     wire=tally[0], ids=ids, T=T,
                                     intra=int(layer.stats.get("intra_node_bytes", -1)))
    return out


def _expected_direct(res: dict, mode: str, rank: int) -> int:
    """Bytes ``rank`` sends to other nodes with one-hop ``direct``, from the routing: its
    rows for experts of other nodes (dispatch, and the gradient of the combine), and the rows
    other nodes' ranks sent it (combine, and the gradient of the dispatch)."""
    P, L, El = 4, 2, E // 4

    def rows(src: int, dst: int) -> int:
        ids, T = res[src][(mode, "direct")]["ids"], res[src][(mode, "direct")]["T"]
        n = torch.bincount(ids.reshape(-1), minlength=E)
        cap = capacity(T, K, E, 1.0) if mode != "dropless" else None
        block = n[dst * El:(dst + 1) * El]
        if mode == "pad":
            return cap * El
        if mode == "trim":
            return int(block.clamp(max=cap).sum())
        return int(block.sum())

    node = rank // L
    remote = [j for j in range(P) if j // L != node]
    out_rows = sum(rows(rank, j) for j in remote)
    in_rows = sum(rows(j, rank) for j in remote)
    return 2 * (out_rows + in_rows) * D_MODEL * 8       # forward and backward, float64


def _expected_node_dedup(res: dict, rank: int) -> int:
    """Bytes ``rank`` (node n, local rank l) sends to other nodes with ``node_dedup``: one
    row per (token, remote node) of its tokens (the token with its k gates, its k expert ids
    as int32, and in backward the gradient of the partial sum), and one row per (token of a rank
    (n', l), node n) it relayed (the partial sum, and in backward the gradient of the token
    and its gates)."""
    L, En, M, el = 2, E // 2, D_MODEL, 8

    def pairs(src: int, node: int) -> int:
        ids = res[src][("dropless", "node_dedup")]["ids"]
        return int(((ids // En) == node).any(1).sum())

    n, l = divmod(rank, L)
    out_pairs = sum(pairs(rank, m) for m in range(2) if m != n)
    in_pairs = sum(pairs(m * L + l, n) for m in range(2) if m != n)
    return out_pairs * (((M + K) + M) * el + K * 4) + in_pairs * (M + (M + K)) * el


def _expected_node_dedup_intra(res: dict, rank: int) -> int:
    """Bytes ``rank`` (node n, local rank l) sends to the other ranks of its node with
    ``node_dedup`` (DeepEP's forwarding: one copy per (token, destination rank), reduced per
    rank on the way back): as the relay, per (token of a rank (m, l), other rank (n, l2) with
    one of its experts) the token with its k gates and k int32 ids, and in backward the
    gradient of that rank's partial sum; as the expert rank, per (token of a rank (m, l1),
    l1 != l, with an expert here) its partial sum, and in backward the gradient of the token
    and its gates."""
    L, El, M, el = 2, E // 4, D_MODEL, 8

    def copies(src: int, dst: int) -> int:
        ids = res[src][("dropless", "node_dedup")]["ids"]
        return int(((ids // El) == dst).any(1).sum())

    n, l = divmod(rank, L)
    out = sum(copies(m * L + l, n * L + l2) for m in range(2) for l2 in range(L) if l2 != l)
    back = sum(copies(m * L + l1, rank) for m in range(2) for l1 in range(L) if l1 != l)
    return out * ((2 * M + K) * el + K * 4) + back * (2 * M + K) * el


@pytest.mark.multirank
def test_node_dedup_intra_node_bytes_are_one_copy_per_rank(results):
    for rank, res in results.items():
        assert res[("dropless", "node_dedup")]["intra"] == _expected_node_dedup_intra(
            results, rank), rank


@pytest.fixture(scope="module")
def results():
    return launch_local(_worker, 4, timeout_s=600)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("algo", ALGOS)
def test_counted_bytes_equal_the_wire(results, mode, algo):
    for rank, res in results.items():
        got = res[(mode, algo)]
        assert got["stat"] == got["wire"], (rank, got["stat"], got["wire"])
    assert sum(res[(mode, algo)]["stat"] for res in results.values()) > 0


@pytest.mark.multirank
@pytest.mark.parametrize("mode", list(MODES))
def test_direct_bytes_follow_the_routing(results, mode):
    for rank, res in results.items():
        assert res[(mode, "direct")]["stat"] == _expected_direct(results, mode, rank), rank


@pytest.mark.multirank
def test_node_dedup_bytes_follow_the_routing(results):
    for rank, res in results.items():
        got = res[("dropless", "node_dedup")]
        assert got["stat"] == got["wire"] == _expected_node_dedup(results, rank), rank
        kept = res[("trim", "node_dedup")]            # capacity: the kept choices travel
        assert kept["stat"] == kept["wire"], rank
    # fewer payload rows cross than with direct: top-2 over 2 nodes has repeated nodes
    assert (sum(r[("dropless", "node_dedup")]["stat"] for r in results.values())
            < sum(r[("dropless", "direct")]["stat"] for r in results.values()))


def test_one_node_sends_nothing_across():
    layer = mf.MoELayer(mf.MoEConfig(d_model=D_MODEL, d_expert=5, num_experts=E, top_k=K))
    layer(torch.randn(7, D_MODEL)).sum().backward()
    assert layer.stats["inter_node_bytes"] == 0.0


@pytest.mark.multirank
@pytest.mark.parametrize("algo", ["direct", "hier2d", "bilevel", "hier1d", "pipe",
                                  "node_dedup"])
def test_simulator_phases_cross_the_counted_bytes(results, algo):
    """``moeflow simulate``'s phases of each all-to-all, planned from the same routing, put on
    inter-node links what the layer counted and the wire carried (forward + backward)."""
    from moeflow.measure.linkmodel import AlphaBeta
    from moeflow.simulate import CostModel, LayerSpec, simulate_layer
    from moeflow.simulate.costs import KINDS

    fit = AlphaBeta(1e-4, 1e-9)
    costs = CostModel({k: fit for k in KINDS},
                      {(c, op): fit for c in ("intra", "inter", "world")
                       for op in ("all_to_all", "all_gather")})
    spec = LayerSpec(tokens=5, d_model=D_MODEL, d_expert=5, num_experts=E, top_k=K,
                     capacity_factor=None, a2a=algo, nodes=2, ranks_per_node=2, dtype="fp64")
    routing = [results[r][("dropless", algo)]["ids"] for r in range(4)]
    sim = simulate_layer(spec, costs, routing)
    assert sim["inter_node_bytes"] == [results[r][("dropless", algo)]["stat"] for r in range(4)]
    if algo == "node_dedup":    # r = 2 chunks, OptSche, int8 on the inter-node hops both ways
        costs.compute["codec:int8"] = fit
        key = ("dropless", "node_dedup_r2_int8")
        sim = simulate_layer(replace(spec, **DEDUP_R2), costs,
                             [results[r][key]["ids"] for r in range(4)])
        got = [results[r][key]["stat"] for r in range(4)]
        assert sim["inter_node_bytes"] == got == [results[r][key]["wire"] for r in range(4)]
        assert sum(got) < sum(results[r][("dropless", algo)]["stat"] for r in range(4))
