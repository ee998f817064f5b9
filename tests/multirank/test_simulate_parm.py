"""The simulator's Parm schedules (moeflow/simulate/parm_model.py) issue, on every rank, exactly the
collectives the library's Parm layer issues: one spawn of 4 gloo ranks (2 nodes x 2) traces one
forward + backward of the real layer per layout, schedule (baseline, S1, S2 with SAA, S2 with
AAS) and routing (capacity, dropless), and the simulator, given the ids the routers picked, must
list the same collectives in the same order: op, group ranks and elements (padding included),
floating-point payloads and int64 bookkeeping alike. Its times are checked with synthetic
fits."""

from __future__ import annotations

import pytest

from moeflow.errors import ConfigError
from moeflow.launch import launch_local
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.simulate.costs import KINDS, CostModel
from moeflow.simulate.parm_model import ParmSpec, simulate_parm
from tests.helpers import parm_simulate_worker as w

CASES = [(layout, sched, f) for layout in w.LAYOUTS for sched in w.SCHEDULES
         for f in w.FACTORS]
OPS = ("p2p", "all_to_all", "all_gather", "reduce_scatter", "all_reduce")


def _costs(a2a=(1e-4, 1e-8)) -> CostModel:
    links = {(c, op): AlphaBeta(*a2a) for c in ("intra", "inter", "world") for op in OPS}
    return CostModel({k: AlphaBeta(0.0, 1e-10) for k in KINDS}, links)


def _spec(layout: str, sched: str, factor) -> ParmSpec:
    mp, ep, esp, in_node = w.LAYOUTS[layout]
    return ParmSpec(tokens=w.TOKENS, d_model=w.M, d_expert=2 * w.M, num_experts=w.E, top_k=2,
                    capacity_factor=factor, mp=mp, ep=ep, esp=esp, esp_in_node=in_node,
                    schedule=sched.split("-")[0], saa=sched != "s2-aas", nodes=2,
                    ranks_per_node=2)


@pytest.fixture(scope="module")
def traces():
    return launch_local(w.worker, 4, timeout_s=300)


def _key(c: dict) -> tuple:
    return (c["phase"], c["op"], tuple(c["ranks"]), c["elements"],
            "int64" if c["dtype"] == "int64" else "float")


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-f{c[2]}")
def test_every_collective_matches_the_library(traces, case):
    spec = _spec(*case)
    routing = [traces[r][case]["ids"] for r in range(4)]
    sim = simulate_parm(spec, _costs(), routing)
    for rank in range(4):
        real = [_key(c) for c in traces[rank][case]["log"] if len(c["ranks"]) > 1]
        assert [_key(c) for c in sim["collectives"][rank]] == real, rank
    if case[2] is None and case[1] == "s1":      # dropless on 7-8 tokens: uneven counts
        assert len({tuple(c) for c in sim["counts"]}) > 1


def test_saa_overlaps_its_gathers_and_aas_does_not():
    """SAA (Fig. 5) runs the MP-AllGather of phase t - 1 beside the exchange of phase t (step t), so with
    slow links S2's step is shorter with SAA than with AAS's all-to-all then AllGather."""
    base = dict(tokens=256, d_model=64, d_expert=128, num_experts=8, top_k=2,
                capacity_factor=1.25, mp=2, ep=2, esp=2, schedule="s2", nodes=2,
                ranks_per_node=4)
    c = _costs(a2a=(1e-4, 1e-7))
    saa = simulate_parm(ParmSpec(**base), c)
    aas = simulate_parm(ParmSpec(**base, saa=False), c)
    assert saa["step_s"] < aas["step_s"]
    ags = [t for t in saa["tasks"] if t["rank"] == 0 and t["task"] == "SAA1/AllGather"]
    p2p = [t for t in saa["tasks"] if t["rank"] == 0 and t["task"] == "SAA1"
           and t["phase"] == "forward"]
    assert ags[0]["start_s"] == p2p[0]["start_s"]


def test_sequential_step_is_the_sum_of_its_tasks():
    """With one chunk every task of a rank runs one after the other: with equal ranks the
    step is the sum of one rank's task times."""
    spec = ParmSpec(tokens=64, d_model=16, d_expert=32, num_experts=4, top_k=2,
                    capacity_factor=1.0, mp=2, ep=2, esp=1, schedule="s1", nodes=2,
                    ranks_per_node=2)
    sim = simulate_parm(spec, _costs())
    mine = [t for t in sim["tasks"] if t["rank"] == 0]
    assert sim["step_s"] == pytest.approx(sum(t["end_s"] - t["start_s"] for t in mine))


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match="schedule='auto'"):
        ParmSpec(tokens=8, d_model=8, d_expert=8, num_experts=4, top_k=1,
                 capacity_factor=None, mp=2, ep=2, schedule="auto", ranks_per_node=4)
    with pytest.raises(ConfigError, match="esp_size=3"):
        ParmSpec(tokens=8, d_model=8, d_expert=9, num_experts=4, top_k=1,
                 capacity_factor=None, esp=3, ranks_per_node=4)
    with pytest.raises(ConfigError, match="d_expert=10"):
        ParmSpec(tokens=8, d_model=8, d_expert=10, num_experts=4, top_k=1,
                 capacity_factor=None, ep=1, esp=4, ranks_per_node=4)
