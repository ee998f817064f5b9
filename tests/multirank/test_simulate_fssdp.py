"""HECATE's FSSDP in the simulator (moeflow/simulate/fssdp_model.py): on 4 gloo ranks as 2 x 2, the
real layer's second call (its ``P'`` from Algorithm 1 on the first call's loads) and the
simulator, given the same router ids, agree exactly on ``P'``, on every task's recorded size
(all-to-all bytes over the held slots, the experts' rows) and on each rank's spAG / spRS bytes;
the placement and times are also checked with no ranks started."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.launch import launch_local
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.strategies.fssdp.materialize import sparse_materialize
from moeflow.strategies.fssdp.placement import Placement
from moeflow.simulate import LayerSpec, lane_orders, simulate_layer
from moeflow.simulate.costs import KINDS, CostModel
from moeflow.simulate.fssdp_model import FSSDPSpec, expert_numel
from moeflow.simulate.loads import sample_routing, zipf_popularity
from tests.helpers import fssdp_simulate_worker as w


def _costs(p2p=(1e-4, 1e-8)) -> CostModel:
    links = {(c, op): AlphaBeta(1e-4, 1e-8) for c in ("intra", "inter", "world")
             for op in ("all_to_all", "all_gather")}
    links.update({(c, "p2p"): AlphaBeta(*p2p) for c in ("intra", "inter")})
    return CostModel({k: AlphaBeta(0.0, 1e-10) for k in KINDS}, links)


def _specs(name: str) -> tuple[LayerSpec, FSSDPSpec]:
    cap, opts, schedule, r = w.CASES[name]
    spec = LayerSpec(tokens=w.TOKENS, d_model=w.D, d_expert=w.H, num_experts=w.EXPERTS,
                     top_k=w.TOP_K, capacity_factor=cap, schedule=schedule, pipeline_degree=r,
                     nodes=2, ranks_per_node=2)
    return spec, FSSDPSpec(**opts)


@pytest.fixture(scope="module")
def recorded():
    return launch_local(w.worker, 4, timeout_s=300)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(w.CASES))
def test_placement_tasks_and_sparse_bytes_match_the_layer(recorded, name):
    spec, fs = _specs(name)
    sim = simulate_layer(spec, _costs(), [recorded[r][name]["ids"] for r in range(4)], fs)
    assert sim["fssdp"]["holders"] == recorded[0][name]["holders"]
    if name != "static-cap":                       # Algorithm 1 replicated something
        assert any(len(h) > 1 for h in sim["fssdp"]["holders"])
    for rank in range(4):
        rec = recorded[rank][name]
        assert sim["fssdp"]["spag_send_bytes"][rank] == rec["spag"]
        assert sim["fssdp"]["sprs_send_bytes"][rank] == rec["sprs"]
        if fs.rematerialize:
            assert rec["spag_backward"][0] == rec["spag"]
            assert [t["size"] for t in sim["tasks"] if t["rank"] == rank
                    and t["task"] == "spAG"] == [rec["spag"]] * 2
        for phase in ("forward", "backward"):
            real = {lane: [t for t, p, ln, _ in rec["records"] if p == phase and ln == lane]
                    for lane in ("compute", "comm")}
            assert lane_orders(sim, rank, phase) == real, (rank, phase)
            sizes = {t["task"]: t["size"] for t in sim["tasks"]
                     if t["rank"] == rank and t["phase"] == phase and "^" in t["task"]}
            assert sizes == {t: s for t, p, _, s in rec["records"] if p == phase}, (rank, phase)


def test_algorithm1_spreads_a_skewed_load_and_costs_its_gathers():
    """Zipf 1.5 on 8 ranks: Algorithm 1's P' (the library's sparse_materialize on the sample's
    loads) lowers the heaviest rank's expert rows against static EP, and its spAG / spRS move
    one expert per replica; with slow point-to-point links the gathers outweigh the gain."""
    spec = LayerSpec(tokens=512, d_model=64, d_expert=128, num_experts=8, top_k=2,
                     capacity_factor=None, nodes=2, ranks_per_node=4)
    routing = sample_routing(zipf_popularity(8, 1.5), 8, 512, 2)
    static = simulate_layer(spec, _costs(), routing, FSSDPSpec())
    sparse_fs = FSSDPSpec(materialize="sparse", overlap_degree=4, memory_capacity=1)
    sparse = simulate_layer(spec, _costs(), routing, sparse_fs)
    plain = simulate_layer(spec, _costs(), routing)
    assert static["expert_rows"] == plain["expert_rows"]          # P' = P is EP's data flow
    assert static["step_s"] == pytest.approx(plain["step_s"], rel=0.05)
    assert max(sparse["expert_rows"]) < max(static["expert_rows"])
    kept = np.bincount(np.concatenate([np.asarray(ids).reshape(-1) for ids in routing]),
                       minlength=8).astype(np.float64)          # dropless: every choice kept
    want = sparse_materialize(Placement.even(8, 8), kept, 4, 1, 4)
    assert sparse["fssdp"]["holders"] == [sorted(h) for h in want.holders]
    nbytes = expert_numel(64, 128, "gelu") * 4
    replicas = sum(len(h) - 1 for h in want.holders)
    assert sum(sparse["fssdp"]["spag_send_bytes"]) == replicas * nbytes
    assert sum(sparse["fssdp"]["sprs_send_bytes"]) == replicas * nbytes
    slow = simulate_layer(spec, _costs(p2p=(1e-4, 1e-6)), routing, sparse_fs)
    assert slow["step_s"] > sparse["step_s"]
    assert slow["busy_s"]["spAG"] > sparse["busy_s"]["spAG"] > 0
