"""``moeflow simulate layer --measured``: the measured twins of codec rows (``bench layer
--codec``), of Parm's rows (``bench parm``) and of HECATE's FSSDP rows (``bench hecate``),
matched by the layer and layout, with every mismatch refused naming the field and flag."""

from __future__ import annotations

import argparse
import json

import pytest

from moeflow.cli import main


def _parm_row(mp, ep, esp, steps, tokens=64, f=1.2) -> dict:
    return {"n_mp": mp, "n_ep": ep, "n_esp": esp, "esp_in_node": True, "tokens_per_rank": tokens,
            "d_model": 32, "d_expert": 64, "num_experts": 4, "top_k": 2,
            "capacity_factor": f, "step_ms": steps}


def _parm_file(tmp_path):
    path = tmp_path / "parm.json"
    steps = {"baseline": 10.0, "s1": 8.0, "s2": 9.0, "s2-aas": 9.5, "auto": 8.1}
    other = {k: 2 * v for k, v in steps.items()}
    path.write_text(json.dumps({
        "topology": "Topology(rank=0, world=4, nodes=2x2, ep=4, expert_dp=1)",
        "fit_sizes": "grid", "fits": {}, "summary": {},
        "rows": [_parm_row(1, 2, 2, other), _parm_row(2, 1, 2, steps),
                 _parm_row(2, 1, 2, other, tokens=128)]}))
    return path


PARM = ["simulate", "layer", "--nodes", "2", "--ranks-per-node", "2", "--profile",
        "parm-testbed-b", "--tokens", "64", "--d-model", "32", "--d-expert", "64",
        "--custom-layer", "--num-experts", "4", "--top-k", "2", "--capacity-factor", "1.2",
        "--compare", "parm:baseline,parm:s1,parm:s2"]


def test_bench_parm_rows_are_the_parm_variants_twins(tmp_path):
    measured, out = _parm_file(tmp_path), tmp_path / "sim.json"
    assert main([*PARM, "--mp", "2", "--esp", "2", "--ep-size", "1", "--measured",
                 str(measured), "--out", str(out), "--out-summary"]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert {v: r["measured_step_ms"] for v, r in rows.items()} == {
        "parm:baseline": 10.0, "parm:s1": 8.0, "parm:s2": 9.0}
    for r in rows.values():
        assert r["measured_world"] == 4 and r["routing"] == "bench parm"
        assert r["predicted_over_measured"] == pytest.approx(r["step_s"] * 1e3
                                                             / r["measured_step_ms"])
    # the other layout of the grid (N_MP 1, N_EP 2, N_ESP 2) is its own row
    assert main([*PARM, "--esp", "2", "--measured", str(measured), "--out", str(out)]) == 0
    assert {r["measured_step_ms"] for r in json.loads(out.read_text())["results"]} == {
        20.0, 16.0, 18.0}


@pytest.mark.parametrize("flags,field", [
    (["--mp", "2", "--esp", "2"], r"n_ep \(measured 1, here 2: --ep-size\)"),
    (["--mp", "2", "--esp", "2", "--ep-size", "1", "--tokens", "96"],
     r"tokens_per_rank \(measured 64, here 96: --tokens\)"),
    (["--mp", "2", "--esp", "2", "--ep-size", "1", "--capacity-factor", "2.4"],
     r"capacity_factor \(measured 1.2, here 2.4"),
    (["--mp", "2", "--esp", "2", "--ep-size", "1", "--nodes", "1", "--ranks-per-node", "4"],
     r"nodes \(measured 2, here 1"),
])
def test_bench_parm_mismatch_names_the_field(tmp_path, flags, field):
    measured = _parm_file(tmp_path)
    with pytest.raises(SystemExit, match=field):
        main([*PARM, *flags, "--measured", str(measured)])


def test_bench_parm_routing_is_per_mp_group():
    """The ranks of an MP group gate one batch (bench parm's input of group rank // N_MP)."""
    from moeflow.cases.parm_grid import case_routing

    r = case_routing(16, 32, 4, 2, 1.2, world=4, mp=2)
    assert r[0].equal(r[1]) and r[2].equal(r[3]) and not r[0].equal(r[2])
    assert r[0].shape == (16, 2)


def test_bench_parm_file_needs_a_parm_variant(tmp_path):
    with pytest.raises(SystemExit, match="add --compare parm:"):
        main([*PARM[:-2], "--measured", str(_parm_file(tmp_path))])


def _hecate_file(tmp_path, labels=("ep", "fssdp static", "fssdp alg1"), drift=0):
    path = tmp_path / "hecate.json"
    rows = [{"zipf_s": s, "variant": v, "step_ms": 10 * (i + 1) + s,
             "tokens_per_rank": [100, 28]}                      # the loads per rank, as bench
            for s in (0.0, 1.0) for i, v in enumerate(labels)]
    path.write_text(json.dumps({
        "topology": "Topology(rank=0, world=2, nodes=1x2, ep=2, expert_dp=1)",
        "options": {"tokens": 64, "d_model": 32, "d_expert": 64, "experts_per_rank": 2,
                    "top_k": 2, "zipf": [0.0, 1.0], "t": 1, "m": 2, "drift": drift},
        "rows": rows}))
    return path


HECATE = ["simulate", "layer", "--nproc", "2", "--profile", "parm-testbed-b", "--tokens", "64",
          "--d-model", "32", "--d-expert", "64", "--custom-layer", "--num-experts", "4",
          "--top-k", "2", "--capacity-factor", "0", "--compare", "ep,fssdp:static,fssdp:sparse",
          "--fssdp", '{"overlap_degree": 1, "memory_capacity": 2}']


def test_bench_hecate_rows_are_the_fssdp_variants_twins(tmp_path):
    from moeflow.cases.skewed import case_routing

    out = tmp_path / "sim.json"
    assert main([*HECATE, "--zipf", "1.0", "--measured", str(_hecate_file(tmp_path)),
                 "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert {v: r["measured_step_ms"] for v, r in rows.items()} == {
        "ep": 11.0, "fssdp:static": 21.0, "fssdp:sparse": 31.0}
    assert all(r["routing"] == "bench hecate, zipf 1.0" for r in rows.values())
    # the routing planned is bench hecate's router at s = 1 (two experts take every choice),
    # not at s = 0 (even)
    def counts(s):
        return sum(p.flatten().bincount(minlength=4) for p in case_routing(64, 32, 64, 4, 2, s, 2))

    assert counts(1.0).min() == 0 and counts(0.0).min() > 0


@pytest.mark.parametrize("flags,field", [
    (["--zipf", "1.5"], r"zipf_s \(measured 1.0, here 1.5: --zipf\)"),
    (["--zipf", "1.0", "--fssdp", '{"overlap_degree": 2, "memory_capacity": 2}'],
     r"t \(measured 1, here 2: --fssdp overlap_degree\)"),
    (["--zipf", "1.0", "--capacity-factor", "1.25"], r"capacity_factor \(measured None"),
    (["--zipf", "1.0", "--d-expert", "128"], r"d_expert \(measured 64, here 128"),
    ([], "give --zipf S"),
])
def test_bench_hecate_mismatch_names_the_field(tmp_path, flags, field):
    with pytest.raises(SystemExit, match=field):
        main([*HECATE, *flags, "--measured", str(_hecate_file(tmp_path))])


def test_bench_hecate_refusals(tmp_path):
    with pytest.raises(SystemExit, match="drift"):
        main([*HECATE, "--zipf", "1.0", "--measured",
              str(_hecate_file(tmp_path, drift=3))])
    with pytest.raises(SystemExit, match="'fssdp alg1' rows"):
        main([*HECATE, "--zipf", "1.0", "--measured",
              str(_hecate_file(tmp_path, labels=("ep", "fssdp static")))])
    with pytest.raises(SystemExit, match="add --compare fssdp:"):
        main([*HECATE[:-4], "--zipf", "1.0", "--measured", str(_hecate_file(tmp_path))])


def _bench_layer_args(**kw) -> argparse.Namespace:
    from moeflow.cli import build_parser

    argv = ["bench", "layer", "--d-model", "16", "--d-expert", "32"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return build_parser().parse_args(argv)


def test_bench_layer_codec_applies_to_its_own_rows():
    """--codec / --codec-backward without --compare: every config under the codec, its name
    unchanged (simulate layer --codec names its rows the same); refusals name the flag."""
    from moeflow.cases.layer_grid import case_config, cases_for
    from moeflow.commands.bench_command import _codec_cases

    args = _bench_layer_args(codec="int8", codec_backward=True)
    base = cases_for(["sequential"], 2)
    cases = _codec_cases(args, base)
    assert [c.name for c in cases] == [c.name for c in base]
    cfg = case_config(cases[0], 16, 32)
    assert (cfg.codec, cfg.codec_backward) == ("int8", True)
    assert case_config(base[0], 16, 32).codec == "none"          # the default: unchanged
    with pytest.raises(SystemExit, match="not a registered codec"):
        _codec_cases(_bench_layer_args(codec="int9"), base)
    with pytest.raises(SystemExit, match="give a codec"):
        _codec_cases(_bench_layer_args(codec_backward=True), base)


@pytest.mark.multirank
def test_bench_layer_codec_run_is_simulate_codec_twin(tmp_path):
    """A 2-rank bench layer --codec int8 run is the measured twin of simulate layer --codec
    int8's rows (one to one, by name); simulate without the codec is refused, naming it."""
    out, sim = tmp_path / "layer.json", tmp_path / "sim.json"
    args = ["--tokens", "32", "--d-model", "8", "--d-expert", "16", "--nproc", "2",
            "--codec", "int8", "--codec-backward"]
    assert main(["bench", "layer", *args, "--warmup", "1", "--reps", "1", "--out",
                 str(out)]) == 0
    measured = json.loads(out.read_text())["results"]
    assert all(r["codec"] == "int8" and r["codec_backward"] for r in measured)
    assert main(["simulate", "layer", *args, "--profile", "schemoe-32gpu", "--measured",
                 str(out), "--out", str(sim), "--out-summary"]) == 0
    rows = json.loads(sim.read_text())["results"]
    assert [r["name"] for r in rows] == [r["name"] for r in measured]
    assert [r["measured_step_ms"] for r in rows] == [r["step_ms"] for r in measured]
    with pytest.raises(SystemExit, match=r"codec='int8', here 'none' \(--codec\)"):
        main(["simulate", "layer", *args[:-3], "--profile", "schemoe-32gpu", "--measured",
              str(out)])
    with pytest.raises(SystemExit, match=r"num_experts=8, here 4 \(--num-experts\)"):
        main(["simulate", "layer", *args, "--num-experts", "4", "--profile", "schemoe-32gpu",
              "--measured", str(out)])


def test_bench_layer_rows_take_num_experts():
    """--num-experts sets every bench layer row's experts (6 or 12 fit 3 nodes of 2 ranks,
    where the default 8 does not); the default stays 8."""
    from moeflow.cases.layer_grid import cases_for

    assert {c.num_experts for c in cases_for(["sequential", "optsche"], 2)} == {8}
    cases = cases_for(["sequential", "optsche"], 2, ("direct", "hier2d"), 12)
    assert len(cases) == 12 and {c.num_experts for c in cases} == {12}


@pytest.mark.multirank
def test_bench_hecate_run_loads_are_the_planned_ones(tmp_path):
    """A 2-rank bench hecate run at Zipf 1: the rows each rank's experts received (EP, static,
    and Algorithm 1's P') are those simulate layer plans from bench hecate's router."""
    out, sim = tmp_path / "hecate.json", tmp_path / "sim.json"
    assert main(["bench", "hecate", "--tokens", "64", "--d-model", "32", "--d-expert", "64",
                 "--experts-per-rank", "2", "--top-k", "2", "--zipf", "1.0", "--t", "1",
                 "--m", "2", "--variants", "ep,fssdp static,fssdp alg1", "--warmup", "1",
                 "--reps", "1", "--nproc", "2", "--out", str(out)]) == 0
    assert main([*HECATE, "--zipf", "1.0", "--measured", str(out), "--out", str(sim),
                 "--out-summary"]) == 0
    measured = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    rows = {r["variant"]: r for r in json.loads(sim.read_text())["results"]}
    for variant, label in (("ep", "ep"), ("fssdp:static", "fssdp static"),
                           ("fssdp:sparse", "fssdp alg1")):
        assert rows[variant]["measured_step_ms"] == measured[label]["step_ms"]
        assert rows[variant]["expert_rows"] == measured[label]["tokens_per_rank"], variant
    assert measured["fssdp alg1"]["replicas"] > 0          # Algorithm 1 replicated an expert
