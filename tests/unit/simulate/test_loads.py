"""Skewed loads in the step simulator (moeflow.simulate.loads): routing samples drawn from a Zipf
popularity or a trained router's loads, planned by the layer's make_plan, so the heaviest rank's
experts set the critical path (HECATE Section 2.2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeflow.errors import ConfigError
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.simulate import CostModel, LayerSpec, simulate_layer
from moeflow.simulate.costs import KINDS
from moeflow.simulate.loads import (parse_trace_spec, sample_routing, trace_popularity,
                                    zipf_popularity)

TRACE = "docs/results/hf/deepseek_aux_free_balance.json"     # moeflow bench router-load


def _costs() -> CostModel:
    return CostModel({k: AlphaBeta(1e-6, 1e-9) for k in KINDS},
                     {("intra", "all_to_all"): AlphaBeta(1e-4, 1e-8),
                      ("intra", "all_gather"): AlphaBeta(1e-4, 1e-8)})


def _spec(**kw) -> LayerSpec:
    base = dict(tokens=512, d_model=16, d_expert=32, num_experts=8, top_k=2,
                capacity_factor=None, schedule="optsche", pipeline_degree=2, ranks_per_node=4)
    return LayerSpec(**{**base, **kw})


def test_zipf_popularity_is_the_hecate_skew():
    p = zipf_popularity(8, 1.2)
    ranks = np.random.default_rng(7).permutation(8) + 1        # bench hecate's shuffle
    assert p.sum() == pytest.approx(1.0)
    assert p[np.argmin(ranks)] == p.max()
    assert p[ranks == 1][0] / p[ranks == 2][0] == pytest.approx(2 ** 1.2)
    assert np.allclose(zipf_popularity(8, 0), 1 / 8)
    with pytest.raises(ConfigError, match="--zipf -1"):
        zipf_popularity(8, -1)


def test_samples_are_distinct_seeded_and_follow_the_popularity():
    p = zipf_popularity(8, 1.5)
    a = sample_routing(p, 2, 4000, 2, seed=3)
    assert [x.shape for x in a] == [(4000, 2)] * 2
    assert all((x[:, 0] != x[:, 1]).all() for x in a)           # top-k: distinct experts
    assert all((x == y).all() for x, y in zip(a, sample_routing(p, 2, 4000, 2, seed=3)))
    assert not (a[0] == sample_routing(p, 2, 4000, 2, seed=4)[0]).all()
    # first choices are draws of p itself (Gumbel-max): frequencies within a few percent
    freq = np.bincount(a[0][:, 0], minlength=8) / 4000
    assert np.abs(freq - p).max() < 0.03
    with pytest.raises(ConfigError, match="fewer than top_k=2"):
        sample_routing(np.array([1.0, 0, 0, 0]), 1, 4, 2)


def test_zipf_grows_the_step_and_the_experts_follow_the_counts():
    spec, c = _spec(), _costs()
    even = simulate_layer(spec, c, sample_routing(zipf_popularity(8, 0), 4, 512, 2))
    skew = simulate_layer(spec, c, sample_routing(zipf_popularity(8, 1.5), 4, 512, 2))
    assert skew["load_max_over_mean"] > 1.5 > even["load_max_over_mean"]
    assert skew["step_s"] > 1.3 * even["step_s"]
    # every rank's expert tasks receive what the count matrix sends to its experts, and the
    # rank with the most rows has the longest forward experts
    N = np.array(skew["counts"])
    for p in range(4):
        e_size = sum(t["size"] for t in skew["tasks"] if t["rank"] == p
                     and t["phase"] == "forward" and t["task"].startswith("E^"))
        assert e_size == N[:, 2 * p:2 * p + 2].sum() * spec.d_model == \
            skew["expert_rows"][p] * spec.d_model
    e_time = [sum(t["end_s"] - t["start_s"] for t in skew["tasks"] if t["rank"] == p
                  and t["task"].startswith("E^")) for p in range(4)]
    assert int(np.argmax(e_time)) == int(np.argmax(skew["expert_rows"]))
    # the critical path is the heaviest rank's: the step is at least its expert time
    assert skew["step_s"] >= max(e_time)


def test_capacity_caps_the_skew():
    """Capacity mode drops past C slots (make_plan): a hot expert costs at most C rows."""
    r = sample_routing(zipf_popularity(8, 2.0), 4, 512, 2)
    capped = simulate_layer(_spec(capacity_factor=1.0), _costs(), r)
    dropless = simulate_layer(_spec(), _costs(), r)
    assert np.array(capped["counts"]).max() <= 512 * 2 // 8
    assert capped["step_s"] < dropless["step_s"]


def test_router_trace(tmp_path):
    p, how = trace_popularity(TRACE + ":0:0", 8)
    loads = np.array(json.load(open(TRACE))[0]["loads_after"][0], dtype=float)
    assert np.allclose(p, loads / loads.sum()) and "run 0" in how and "MoE layer 0" in how
    assert parse_trace_spec("a:b.json:2:1") == ("a:b.json", 2, 1)
    assert parse_trace_spec("x.json") == ("x.json", 0, 0)
    assert trace_popularity(TRACE + ":2", 8)[0].std() < p.std()      # aux-free balanced run
    with pytest.raises(ConfigError, match="run 5 is out of range"):
        trace_popularity(TRACE + ":5", 8)
    with pytest.raises(ConfigError, match="the trace has 8 experts, the simulated layer 16"):
        trace_popularity(TRACE, 16)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "moeflow.links/1"}))
    with pytest.raises(ConfigError, match="not a router_load JSON"):
        trace_popularity(str(bad), 8)


def test_cli_zipf_and_trace(tmp_path, capsys):
    from moeflow.cli import main

    args = ["simulate", "layer", "--nproc", "4", "--profile", "schemoe-32gpu", "--tokens", "256",
            "--schedules", "sequential"]
    rows = {}
    for name, extra in (("uniform", ["--routing", "uniform"]), ("zipf", ["--zipf", "1.5"]),
                        ("trace", ["--router-trace", TRACE])):
        out = tmp_path / f"{name}.json"
        assert main([*args, *extra, "--out", str(out)]) == 0
        rows[name] = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert "heaviest rank" in capsys.readouterr().out
    row = "dropless-top2"
    assert rows["zipf"][row]["routing"] == "zipf 1.5, seed 0"
    assert rows["trace"][row]["routing"].startswith("router trace " + TRACE)
    assert rows["zipf"][row]["step_s"] > rows["uniform"][row]["step_s"]
    assert rows["trace"][row]["step_s"] > rows["uniform"][row]["step_s"]
    with pytest.raises(SystemExit, match="give one"):
        main([*args, "--zipf", "1", "--routing", "bench"])


def test_cli_out_summary_keeps_the_predictions_without_the_task_lists(tmp_path):
    from moeflow.cli import main

    args = ["simulate", "layer", "--nproc", "4", "--profile", "schemoe-32gpu", "--tokens", "256",
            "--schedules", "sequential", "--routing", "uniform"]
    full, short = tmp_path / "full.json", tmp_path / "short.json"
    assert main([*args, "--out", str(full)]) == 0
    assert main([*args, "--out", str(short), "--out-summary"]) == 0
    rows = json.loads(full.read_text())["results"]
    kept = json.loads(short.read_text())["results"]
    assert rows and all(r["tasks"] for r in rows)
    assert kept == [{k: v for k, v in r.items() if k not in ("tasks", "collectives")}
                    for r in rows]
