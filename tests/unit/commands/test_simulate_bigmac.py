"""``moeflow simulate bigmac`` (moeflow/commands/simulate_bigmac.py): bench bigmac's arguments,
its rows predicted one to one (``--measured`` lines them up), its counted bytes per token
predicted; ``simulate layer --compare bigmac`` and ``simulate train --set
moe.structure=bigmac``."""

from __future__ import annotations

import json

import pytest
import torch

from moeflow.cli import build_parser, main

ARGS = ["--nproc", "2", "--tokens", "64", "--d-model", "32", "--d-expert", "16",
        "--num-experts", "8", "--top-k", "2,4", "--structures", "vanilla,fine_grained,bigmac",
        "--granularity", "2"]


def test_same_arguments_as_bench_bigmac():
    parser = build_parser()
    bench = vars(parser.parse_args(["bench", "bigmac", *ARGS]))
    sim = vars(parser.parse_args(["simulate", "bigmac", *ARGS]))
    skip = ("func", "bench", "command", "simulate")
    assert {k: v for k, v in sim.items() if k in bench and k not in skip} == \
        {k: v for k, v in bench.items() if k not in skip}


def test_rows_line_up_with_bench_bigmac_and_bytes_are_the_formula(tmp_path, capsys):
    from moeflow.cases.structures import case_config, default_cases, expected_a2a_bytes

    cases = default_cases(8, 16, [2, 4], 0.25, ["vanilla", "fine_grained", "bigmac"], 2)
    measured = tmp_path / "bench.json"       # a bench bigmac --out file's fields
    measured.write_text(json.dumps({"command": "moeflow bench bigmac", "results": [
        {"name": c.name, "world_size": 2, "tokens_per_rank": 64, "step_ms": 1.0 + i,
         "a2a_bytes_per_token": 0.0} for i, c in enumerate(cases)],
        "speedup_fine_over_bigmac": {}}))
    out = tmp_path / "sim.json"
    assert main(["simulate", "bigmac", *ARGS, "--profile", "bigmac-32gpu", "--measured",
                 str(measured), "--out", str(out), "--out-summary"]) == 0
    data = json.loads(out.read_text())
    rows = data["results"]
    assert [r["name"] for r in rows] == [c.name for c in cases]
    assert [r["measured_step_ms"] for r in rows] == [1.0 + i for i in range(len(cases))]
    for r, c in zip(rows, cases):
        # the bench's own formula (4 k w elements per token dropless; E*C padded rows)
        want = expected_a2a_bytes(case_config(c, 32), 64, 4) / 64
        assert r["a2a_bytes_per_token"] == pytest.approx(want), c.name
        assert "tasks" not in r
    by = {r["name"]: r for r in rows}
    assert by["bigmac-r0.25-E8-top4"]["width"] == 8
    assert 4 * by["bigmac-r0.25-E8-top4"]["a2a_bytes_per_token"] == \
        by["fine_grained-E8-top4"]["a2a_bytes_per_token"]
    assert set(data["predicted_speedup_fine_over_bigmac"]) == {"2", "4"}
    assert "predicted BigMac speedup" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="predict it with `moeflow simulate bigmac`"):
        main(["simulate", "layer", "--profile", "bigmac-32gpu", "--measured", str(measured)])
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"results": []}))
    with pytest.raises(SystemExit, match="not a `moeflow bench bigmac --out` file"):
        main(["simulate", "bigmac", *ARGS, "--profile", "bigmac-32gpu", "--measured",
              str(bad)])


def test_bench_routing_is_the_measured_layers():
    """--routing bench plans the ids the timed layer's router picks on its inputs."""
    from moeflow import MoELayer, Topology
    from moeflow.cases.structures import StructureCase, case_config, case_input, case_routing

    case = StructureCase("bigmac", 8, 4, 16, 0.25)
    layer = MoELayer(case_config(case, 32), Topology.single())
    got = {}
    layer.router.register_forward_hook(lambda _m, _i, out: got.update(ids=out.experts))
    with torch.no_grad():
        layer(case_input(64, 32, 1))
    assert torch.equal(case_routing(case, 2, 64, 32)[1], got["ids"])


def test_layer_variant_and_train(tmp_path, capsys):
    layer = ["simulate", "layer", "--custom-layer", "--num-experts", "8", "--top-k", "4",
             "--capacity-factor", "0", "--tokens", "256", "--d-model", "64", "--d-expert", "32",
             "--nodes", "2", "--ranks-per-node", "2", "--profile", "bigmac-32gpu",
             "--routing", "uniform"]
    out = tmp_path / "layer.json"
    assert main([*layer, "--compare", "ep,bigmac", "--downscale-factor", "0.5",
                 "--out", str(out)]) == 0
    ep, big = json.loads(out.read_text())["results"]
    assert (ep["width"], big["width"]) == (64, 32)
    assert big["comm_s"] < ep["comm_s"]
    with pytest.raises(SystemExit, match="--downscale-factor is read by the bigmac variant"):
        main([*layer, "--downscale-factor", "0.5"])
    train = ["simulate", "train", "--preset", "tiny", "--nproc", "2", "--profile",
             "bigmac-32gpu", "--set", "moe.num_experts=8", "--set", "moe.top_k=4"]
    steps = {}
    for s in ("fine_grained", "bigmac"):
        out = tmp_path / f"{s}.json"
        assert main([*train, "--set", f"moe.structure={s}", "--out", str(out)]) == 0
        steps[s] = json.loads(out.read_text())["results"][0]
    assert steps["bigmac"]["moe_layer"]["comm_s"] < steps["fine_grained"]["moe_layer"]["comm_s"]
    out = tmp_path / "fp16.json"          # --dtype: the profile's fp16 peak, 2-byte payloads
    assert main([*train, "--set", "moe.structure=bigmac", "--dtype", "fp16", "--out",
                 str(out)]) == 0
    half = json.loads(out.read_text())["results"][0]
    assert half["parts_s"]["attention"] < steps["bigmac"]["parts_s"]["attention"]
    assert half["moe_layer"]["comm_s"] < steps["bigmac"]["moe_layer"]["comm_s"]
    with pytest.raises(SystemExit, match="--set moe.structure=bigmac"):
        main([*train, "--compare", "ep,bigmac"])
    with pytest.raises(SystemExit, match="BigMac's reduced width under MP"):
        main([*train, "--set", "moe.structure=bigmac", "--mp", "2"])
