"""The step simulator (moeflow.simulate; ScheMoE Section 4's lanes on every rank): it runs the
library's own task graphs, so on a real 2-rank run it must reproduce what the executor records
(the task order on each lane, the bytes of every all-to-all, given the routing the router
chose); its arithmetic is checked against hand-computed times with synthetic fits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from moeflow.errors import ConfigError
from moeflow.launch import launch_local
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.simulate import CostModel, LayerSpec, lane_orders, simulate_layer
from moeflow.simulate.costs import KINDS
from tests.helpers import simulate_worker as w


def _costs(compute=(0.0, 1e-9), a2a=(1e-3, 1e-6), p2p=(1e-4, 1e-6),
           gather=(5e-4, 1e-6)) -> CostModel:
    return CostModel({k: AlphaBeta(*compute) for k in KINDS},
                     {("intra", "all_to_all"): AlphaBeta(*a2a),
                      ("intra", "p2p"): AlphaBeta(*p2p),
                      ("intra", "all_gather"): AlphaBeta(*gather)})


@pytest.fixture(scope="module")
def recorded():
    return launch_local(w.worker, 2, timeout_s=240)


def _spec(cap, schedule, r, codec="none", codec_backward=False) -> LayerSpec:
    return LayerSpec(tokens=w.TOKENS, d_model=w.D, d_expert=w.H, num_experts=w.EXPERTS,
                     top_k=w.TOP_K, capacity_factor=cap, schedule=schedule,
                     pipeline_degree=r, ranks_per_node=2, codec=codec,
                     codec_backward=codec_backward)


def _codec_costs() -> CostModel:
    c = _costs()
    c.compute.update({f"codec:{n}": AlphaBeta(1e-5, 1e-9) for n in ("int8", "fp16")})
    return c


def _assert_tasks_match(sim: dict, recs: list, rank: int) -> None:
    """Each lane's task order per pass, and every task's recorded size (elements for
    computing tasks, bytes on the wire for the all-to-alls), as the executor recorded them."""
    for phase in ("forward", "backward"):
        real = {lane: [t for t, p, ln, _ in recs if p == phase and ln == lane]
                for lane in ("compute", "comm")}
        assert lane_orders(sim, rank, phase) == real, (rank, phase)
        sim_sizes = {t["task"]: t["size"] for t in sim["tasks"]
                     if t["rank"] == rank and t["phase"] == phase and "^" in t["task"]}
        assert sim_sizes == {t: s for t, p, _, s in recs if p == phase}, (rank, phase)


@pytest.mark.parametrize("case", w.CASES + w.CODEC_CASES,
                         ids=lambda c: f"cap{c[0]}-{c[1]}-r{c[2]}" + "".join(
                             f"-{x}" for x in c[3:]))
def test_lane_orders_and_bytes_match_the_executor(recorded, case):
    routing = [recorded[rank][case]["ids"] for rank in (0, 1)]
    sim = simulate_layer(_spec(*case), _codec_costs(), routing)
    for rank in (0, 1):
        _assert_tasks_match(sim, recorded[rank][case]["records"], rank)
    # dropless routing on 24 tokens is uneven: the check is not one of equal splits
    if case[0] is None:
        assert len({tuple(row) for row in sim["counts"]}) > 1 or \
            len(set(sim["counts"][0])) > 1


def _check_dedup(recorded: dict, case: tuple) -> None:
    """node_dedup at r = 2 (2 nodes x 1): the simulator's tasks run on each lane in the
    executor's order, forward and scheduled backward, every task's recorded size is the
    simulator's (elements) for the computing tasks, and the lane tasks put on inter-node links
    the bytes the layer counted (its stats["inter_node_bytes"]: codec payloads, gates, ids)."""
    cap, schedule, r, codec, codec_backward = case
    key = ("node_dedup", *case)
    routing = [recorded[rank][key]["ids"] for rank in (0, 1)]
    spec = LayerSpec(tokens=w.TOKENS, d_model=w.D, d_expert=w.H, num_experts=w.EXPERTS,
                     top_k=w.TOP_K, capacity_factor=cap, schedule=schedule,
                     pipeline_degree=r, nodes=2, ranks_per_node=1, a2a="node_dedup",
                     codec=codec, codec_backward=codec_backward)
    costs = _codec_costs()
    costs.links.update({("inter", op): AlphaBeta(1e-3, 1e-6) for op in ("all_to_all",
                                                                        "all_gather")})
    sim = simulate_layer(spec, costs, routing)
    for rank in (0, 1):
        recs = recorded[rank][key]["records"]
        for phase in ("forward", "backward"):
            real = {lane: [t for t, p, ln, _ in recs if p == phase and ln == lane]
                    for lane in ("compute", "comm")}
            assert len(real["comm"]) == 2 * r
            assert lane_orders(sim, rank, phase) == real, (rank, phase)
            sim_sizes = {t["task"]: t["size"] for t in sim["tasks"] if t["rank"] == rank
                         and t["phase"] == phase and t["lane"] == "compute" and "^" in t["task"]}
            assert sim_sizes == {t: s for t, p, ln, s in recs
                                 if p == phase and ln == "compute"}, (rank, phase)
        assert sim["inter_node_bytes"][rank] == recorded[rank][key]["inter_node_bytes"] > 0
    # the count exchange: once per call, every chunk's counts in one all-gather
    counts = [t for t in sim["tasks"] if t["task"] == "counts" and t["rank"] == 0]
    assert len(counts) == 1 and counts[0]["size"] == 2 * r * (w.EXPERTS + 2) * 8


@pytest.mark.parametrize("case", w.DEDUP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_node_dedup_lane_orders_and_bytes_match_the_executor(recorded, case):
    _check_dedup(recorded, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", w.DEDUP_SLOW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_node_dedup_codec_lane_orders_and_bytes_match_the_executor(case):
    _check_dedup(launch_local(w.dedup_worker, 2, timeout_s=240), case)


def _structure_spec(cap, schedule, r, structure) -> LayerSpec:
    return LayerSpec(tokens=w.TOKENS, d_model=w.D, d_expert=w.H, num_experts=w.EXPERTS,
                     top_k=w.TOP_K, capacity_factor=cap, schedule=schedule,
                     pipeline_degree=r, ranks_per_node=2, structure=structure)


@pytest.mark.parametrize("case", w.BIGMAC_CASES, ids=lambda c: "-".join(map(str, c)))
def test_bigmac_sizes_and_bytes_match_the_layer(recorded, case):
    """BigMac's DCCA (Eq. 2): every recorded task's size (compute: elements at r*d_model;
    comm: bytes on the wire) and the bytes the layer handed to the all-to-all (the counting
    algorithm, forward + backward) are the simulator's; its lanes run in the executor's order."""
    routing = [recorded[rank][case]["ids"] for rank in (0, 1)]
    spec = _structure_spec(*case)
    sim = simulate_layer(spec, _costs(), routing)
    for rank in (0, 1):
        _assert_tasks_match(sim, recorded[rank][case]["records"], rank)
        sent = sum(v[rank] for v in sim["step_bytes"].values())
        assert sent == recorded[rank][case]["payload_bytes"] > 0
    if case[3] == "bigmac":             # the same routing at d_model: r = 0.25 of the bytes
        fine = simulate_layer(replace(spec, structure="fine_grained"), _costs(), routing)
        assert sim["width"] * 4 == fine["width"] == w.D
        for key, b in sim["step_bytes"].items():
            assert [4 * v for v in b] == fine["step_bytes"][key]
        # measured: the router reads x (before descending), so both layers route alike, and
        # the fine-grained layer hands the all-to-all 1/r times BigMac's bytes
        fine_case = (*case[:3], "fine_grained")
        for p in (0, 1):
            assert recorded[p][case]["ids"] == recorded[p][fine_case]["ids"]
            assert 4 * recorded[p][case]["payload_bytes"] == \
                recorded[p][fine_case]["payload_bytes"]


def test_uniform_expectation_bytes():
    spec = LayerSpec(tokens=64, d_model=8, d_expert=16, num_experts=4, top_k=2,
                     capacity_factor=1.25, pipeline_degree=2, ranks_per_node=2)
    sim = simulate_layer(spec, _costs())
    # 64 x 2 choices over 4 experts: 32 rows each (< capacity 40); 2 experts per rank,
    # chunks of 16 rows per expert: each chunk sends 16 rows to each of the 2 ranks
    assert sim["counts"] == [[32] * 4] * 2
    assert sim["a2a_bytes"]["A1^1"] == [2 * 2 * 16 * 8 * 4] * 2
    padded = simulate_layer(LayerSpec(**{**sim["spec"], "trim_padding": False,
                                         "capacity_factor": 2.0}), _costs())
    assert padded["counts"] == [[64] * 4] * 2      # C = 2 x 2 x 64 / 4 slots, all sent


def test_sequential_step_is_the_sum_of_its_tasks():
    """Sequential overlaps nothing: the step is every task's time on one lane (Eq. 10)."""
    spec = LayerSpec(tokens=64, d_model=8, d_expert=16, num_experts=4, top_k=2,
                     capacity_factor=None, schedule="sequential", pipeline_degree=2,
                     ranks_per_node=2)
    c = _costs()
    sim = simulate_layer(spec, c)
    chunk_bytes = 2 * 2 * 16 * 8 * 4       # rows of a chunk x d_model x 4 bytes
    a2a = c.link("intra", "all_to_all").predict(chunk_bytes)
    rows = 64 * 2                           # rows each rank's experts receive per pass
    experts = 1e-9 * (2 * rows * 2 * 8 * 16) * (1 + 2)    # forward + backward FLOPs
    gather = 1e-9 * 2 * rows * 8 * 4        # C1's gather of each pass (r > 1)
    combine = 1e-9 * (2 * rows * 8 * 4 + 64 * 8 * 4 + 2 * rows * 8 * 4)
    permute = 1e-9 * 2 * rows * 8 * 4
    route = 1e-9 * (2 * 64 * 8 * 4 + 4 * 64 * 4 * 4) + 1e-9 * (4 * 64 * 8 * 4 + 4 * 64 * 4 * 4)
    counts = c.link("intra", "all_gather").predict(2 * 4 * 8)     # the count matrix, int64
    want = 8 * a2a + counts + experts + 2 * gather + 2 * combine + 2 * permute + route
    assert sim["step_s"] == pytest.approx(want, rel=1e-9)
    assert sim["comm_s"] == pytest.approx(8 * a2a + counts, rel=1e-9)


def test_overlap_hides_communication_and_optsche_is_no_slower():
    """With communication as long as the experts, the pipelined schedules hide part of it; the
    optimal order (ScheMoE Theorem 1) is never slower than the pipelined one."""
    base = dict(tokens=256, d_model=32, d_expert=64, num_experts=4, top_k=2,
                capacity_factor=None, ranks_per_node=2)
    c = _costs(compute=(1e-5, 2e-10), a2a=(1e-4, 2e-8))
    steps = {}
    for s in ("sequential", "pipelined", "optsche"):
        steps[s] = simulate_layer(LayerSpec(**base, schedule=s, pipeline_degree=4), c)["step_s"]
    assert steps["pipelined"] < steps["sequential"]
    assert steps["optsche"] <= steps["pipelined"] + 1e-12


def test_pairwise_rounds_use_p2p_fits():
    spec = LayerSpec(tokens=64, d_model=8, d_expert=16, num_experts=4, top_k=2,
                     capacity_factor=None, a2a="pairwise", ranks_per_node=2)
    sim = simulate_layer(spec, _costs())
    a1 = [t for t in sim["tasks"] if t["task"] == "A1^1" and t["phase"] == "forward"]
    # one round (P - 1 = 1): each rank sends 32 rows x 2 experts to the other
    assert a1[0]["end_s"] - a1[0]["start_s"] == pytest.approx(1e-4 + 1e-6 * 64 * 8 * 4)
    assert a1[0]["link"] == "intra"


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match="a2a='auto' has no link model"):
        LayerSpec(tokens=8, d_model=8, d_expert=8, num_experts=4, top_k=1,
                  capacity_factor=None, a2a="auto", nodes=2)
    with pytest.raises(ConfigError, match="a2a='pipe' needs several nodes"):
        LayerSpec(tokens=8, d_model=8, d_expert=8, num_experts=4, top_k=1,
                  capacity_factor=None, a2a="pipe", ranks_per_node=4)
    with pytest.raises(ConfigError, match="a2a='hier2d' needs several nodes"):
        LayerSpec(tokens=8, d_model=8, d_expert=8, num_experts=4, top_k=1,
                  capacity_factor=None, a2a="hier2d", ranks_per_node=4)
    with pytest.raises(ConfigError, match="num_experts=3"):
        LayerSpec(tokens=8, d_model=8, d_expert=8, num_experts=3, top_k=1,
                  capacity_factor=None, ranks_per_node=2)
    spec = LayerSpec(tokens=8, d_model=8, d_expert=8, num_experts=4, top_k=1,
                     capacity_factor=None, nodes=2, ranks_per_node=2)
    with pytest.raises(ConfigError, match="'world'"):
        simulate_layer(spec, _costs())


def test_cli_matches_bench_layer_arguments(tmp_path, capsys):
    from moeflow.cli import build_parser, main

    comp = tmp_path / "compute.json"
    comp.write_text(json.dumps({"schema": "moeflow.compute/1", "fits": [
        {"kind": k, "alpha_s": 1e-5, "beta_s_per_unit": 1e-10} for k in KINDS]}))
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"schema": "moeflow.links/1", "fits": [
        {"group": "intra", "op": op, "alpha_s": 1e-4, "beta_s_per_byte": 1e-9}
        for op in ("all_to_all", "all_gather")]}))
    bench_args = ["--tokens", "64", "--d-model", "16", "--d-expert", "32", "--nproc", "2",
                  "--schedules", "sequential,optsche", "--pipeline-degree", "2"]
    parser = build_parser()
    bench = vars(parser.parse_args(["bench", "layer", *bench_args]))
    sim = vars(parser.parse_args(["simulate", "layer", *bench_args]))
    skip = ("func", "bench", "command")
    assert {k: v for k, v in sim.items() if k in bench and k not in skip} == \
        {k: v for k, v in bench.items() if k not in skip}      # every bench layer argument
    out = tmp_path / "sim.json"
    assert main(["simulate", "layer", *bench_args, "--links", str(links), "--compute",
                 str(comp), "--out", str(out), "--gantt", str(tmp_path / "g")]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["name"] for r in rows][-1] == "gshard-top2-optsche-r2"
    assert all(r["world"] == 2 and r["step_s"] > 0 for r in rows)
    assert (tmp_path / "g-gshard-top2-optsche-r2.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="do not divide"):
        main(["simulate", "layer", *bench_args, "--nodes", "4", "--ranks-per-node", "4",
              "--profile", "schemoe-32gpu"])


def test_profile_stands_in_for_measured_fits():
    """A datasheet profile gives every fit the layer needs; across nodes the all-to-all takes
    the inter-node link, so 8 nodes x 4 ranks communicate longer than 1 node x 4 ranks."""
    from moeflow.measure.profiles import load_profile
    from moeflow.simulate import cost_model

    prof = load_profile("schemoe-32gpu")
    base = dict(tokens=1024, d_model=256, d_expert=512, num_experts=32, top_k=2,
                capacity_factor=1.25, schedule="optsche", pipeline_degree=2)
    one = simulate_layer(LayerSpec(**base, nodes=1, ranks_per_node=4),
                         cost_model(profile=prof, nodes=1, ranks_per_node=4))
    many = simulate_layer(LayerSpec(**base, nodes=8, ranks_per_node=4),
                          cost_model(profile=prof, nodes=8, ranks_per_node=4))
    assert {t["link"] for t in many["tasks"] if t["task"].startswith("A")} == {"world"}
    assert many["comm_s"] > one["comm_s"] > 0
    assert one["busy_s"]["E"] == pytest.approx(many["busy_s"]["E"])


def test_bench_routing_is_the_measured_layers():
    """``simulate layer --routing bench`` plans the ids the measured layer's router picks."""
    import torch

    from moeflow import MoELayer, Topology
    from moeflow.cases.layer_grid import case_config, case_input, case_routing, cases_for

    case = cases_for(["optsche"], 2)[-1]
    layer = MoELayer(case_config(case, 16, 32), Topology.single())
    got = {}

    def keep(_m, _i, out) -> None:
        got["ids"] = out.experts

    layer.router.register_forward_hook(keep)
    layer(case_input(40, 16, 0).requires_grad_()).sum().backward()
    assert torch.equal(case_routing(case, 1, 40, 16, 32)[0], got["ids"])


def test_engine_reports_collectives_in_different_orders():
    """Two ranks issuing two collectives in opposite orders would hang; the model says so."""
    from moeflow.simulate import engine
    from moeflow.simulate.engine import SimTask

    def lane(rank, first, second):
        return [SimTask(n, rank, "comm", "comm", "forward", 1.0, collective=n)
                for n in (first, second)]

    ok = {(0, "comm"): lane(0, "a", "b"), (1, "comm"): lane(1, "a", "b")}
    assert engine.run(ok) == 2.0
    with pytest.raises(RuntimeError, match="deadlocks"):
        engine.run({(0, "comm"): lane(0, "a", "b"), (1, "comm"): lane(1, "b", "a")})


def test_local_size_makes_the_bench_layer_nodes(tmp_path):
    from moeflow.cli import main

    out = tmp_path / "sim.json"
    assert main(["simulate", "layer", "--nproc", "4", "--local-size", "2", "--algorithms",
                 "direct,pairwise", "--profile", "schemoe-32gpu", "--tokens", "64",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["world"] for r in rows} == {4}
    assert {r["name"].split("@")[1] for r in rows} == {"direct", "pairwise"}
    with pytest.raises(SystemExit, match="does not divide"):
        main(["simulate", "layer", "--nproc", "4", "--local-size", "3", "--profile",
              "schemoe-32gpu"])


def test_compare_predicts_variants_side_by_side(tmp_path, capsys):
    """``--compare A,B,...``: every config under each variant, with the ratio to the first;
    Parm's and HECATE's variants run their own models; peers and unknown names are refused."""
    from moeflow.cli import main

    out = tmp_path / "cmp.json"
    args = ["simulate", "layer", "--nodes", "2", "--ranks-per-node", "2", "--profile",
            "parm-testbed-b", "--tokens", "64", "--d-model", "32", "--d-expert", "64",
            "--routing", "uniform"]
    parm = ["--mp", "2", "--esp", "2"]
    assert main([*args, *parm, "--compare", "parm:baseline,parm:s1,parm:s2,ep,fssdp:sparse",
                 "--fssdp", '{"overlap_degree": 2, "memory_capacity": 1}',
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    by = {(r["case"], r["variant"]): r for r in rows}
    assert {r["variant"] for r in rows} == {"parm:baseline", "parm:s1", "parm:s2", "ep",
                                            "fssdp:sparse"}
    for (case, variant), r in by.items():
        first = by[(case, "parm:baseline")]["step_s"]
        assert r["ratio_to_first"] == pytest.approx(r["step_s"] / first)
    assert by[("gshard-top2-cap1.25", "parm:s1")]["spec"]["mp"] == 2
    assert "fssdp" in by[("gshard-top2-cap1.25", "fssdp:sparse")]
    text = capsys.readouterr().out
    assert "x first" in text and "[parm:s2]" in text and "share one batch" in text
    for bad, msg in (("tutel", "not modelled"), ("parm:auto", "choose from"),
                     ("ep,ep", "twice")):
        with pytest.raises(SystemExit, match=msg):
            main([*args, "--compare", bad])
    with pytest.raises(SystemExit, match="one chunk"):
        main([*args, *parm, "--compare", "parm:s1", "--schedules", "sequential,optsche"])
    with pytest.raises(SystemExit, match="no variant is a Parm one"):
        main([*args, *parm, "--compare", "ep,fssdp:static"])
    with pytest.raises(SystemExit, match="does not read"):
        main([*args, "--compare", "fssdp:sparse", "--fssdp", '{"window": 3}'])


def test_custom_layer_replaces_the_bench_configs(tmp_path):
    """``--custom-layer``: one layer of --num-experts / --top-k / --capacity-factor (0:
    dropless) / --activation, a row per further schedule, as a paper's setting needs."""
    from moeflow.cli import main

    out = tmp_path / "c.json"
    assert main(["simulate", "layer", "--custom-layer", "--num-experts", "16", "--top-k", "1",
                 "--capacity-factor", "0", "--activation", "swiglu", "--nproc", "4",
                 "--profile", "schemoe-32gpu", "--tokens", "64", "--routing", "uniform",
                 "--schedules", "sequential,optsche", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["name"] for r in rows] == ["custom-e16-top1-dropless-swiglu",
                                         "custom-e16-top1-dropless-swiglu-optsche-r2"]
    spec = rows[0]["spec"]
    assert (spec["num_experts"], spec["top_k"], spec["capacity_factor"],
            spec["activation"]) == (16, 1, None, "swiglu")
    assert rows[1]["spec"]["schedule"] == "optsche"


def test_profile_inter_groups_share_the_node_link():
    """A profile's ``inter`` class (one rank per node) runs its ranks_per_node groups at once,
    as bench links measures it: the node's link is shared, so the slope grows with them."""
    from moeflow.measure.profiles import load_profile
    from moeflow.simulate.costs import profile_links

    prof = load_profile("schemoe-32gpu")
    one = profile_links(prof, 8, 1)[("inter", "all_to_all")]
    four = profile_links(prof, 8, 4)[("inter", "all_to_all")]
    assert four.beta == pytest.approx(4 * one.beta)
    assert one.beta == pytest.approx(7 / 8 / prof.inter.bandwidth_Bps)
    links = profile_links(prof, 8, 4)
    assert links[("inter", "all_reduce")].beta == pytest.approx(2 * four.beta)
    assert links[("world", "reduce_scatter")] == links[("world", "all_gather")]
