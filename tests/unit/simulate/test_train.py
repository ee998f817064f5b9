"""``moeflow simulate train`` (moeflow/simulate/train.py): a whole step of the MoE GPT as the sum
of its dense blocks, every MoE layer's simulated step, the gradient all-reduces and the
optimizer, from ``moeflow train``'s model arguments."""

from __future__ import annotations

import json

import pytest

from moeflow.config import model_preset
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.simulate import LayerSpec, simulate_layer
from moeflow.simulate.costs import KINDS, CostModel
from moeflow.simulate.train import OPTIMIZER_BYTES_PER_PARAM, TrainSpec, simulate_train


def _costs() -> CostModel:
    links = {(c, op): AlphaBeta(1e-4, 1e-9) for c in ("intra", "inter", "world")
             for op in ("all_to_all", "all_gather", "all_reduce", "p2p")}
    return CostModel({k: AlphaBeta(1e-6, 1e-11) for k in KINDS}, links)


def test_the_step_is_its_parts_and_the_moe_part_is_the_layer_model():
    c = _costs()
    T, M, S, F, V, H = 512, 64, 128, 256, 256, 4
    layer = simulate_layer(LayerSpec(tokens=T, d_model=M, d_expert=128, num_experts=8,
                                     top_k=2, capacity_factor=1.25, ranks_per_node=4), c)
    spec = TrainSpec(tokens=T, seq_len=S, d_model=M, n_heads=H, d_ff=F, vocab_size=V,
                     n_layers=4, moe_blocks=(1, 3), dense_params=1000, expert_params=500,
                     dp_size=4, expert_dp_size=1, ranks_per_node=4)
    res = simulate_train(spec, c, {1: layer, 3: layer})
    parts = res["parts_s"]
    assert res["step_s"] == pytest.approx(sum(parts.values()))
    assert parts["moe_layers"] == pytest.approx(2 * layer["step_s"])
    g = lambda f: (1e-6 + 1e-11 * f) + (1e-6 + 1e-11 * 2 * f)          # noqa: E731
    el = lambda b: 3 * (1e-6 + 1e-11 * b)                              # noqa: E731
    attention = 4 * (g(8 * T * M * M) + g(4 * T * S * M)
                     + el(4 * T * M * 4 + 2 * T * H * S * 4 + 6 * T * M * 4))
    assert parts["attention"] == pytest.approx(attention)
    assert parts["dense_ffn"] == pytest.approx(2 * (g(4 * T * M * F) + el(2 * T * F * 4)))
    assert parts["grad_sync"] == pytest.approx(1e-4 + 1e-9 * 4000)     # dense only: EP = world
    assert parts["optimizer"] == pytest.approx(1e-6 + 1e-11 * OPTIMIZER_BYTES_PER_PARAM * 1500)
    assert "mp_all_reduce" not in parts
    tp = simulate_train(TrainSpec(**{**res["spec"], "mp": 2, "moe_blocks": (1, 3)}), c,
                        {1: layer, 3: layer})
    # Megatron's g and f: 2 per block (attention) + 2 per dense block (FFN), T x M fp32
    assert tp["parts_s"]["mp_all_reduce"] == pytest.approx(2 * (4 + 2) * (1e-4 + 1e-9 * T * M * 4))
    assert tp["parts_s"]["attention"] < parts["attention"]


def test_cli_takes_train_model_arguments(tmp_path, capsys):
    from moeflow.cli import build_parser, main

    parser = build_parser()
    train = vars(parser.parse_args(["train", "--preset", "small", "--set", "top_k=1"]))
    sim = vars(parser.parse_args(["simulate", "train", "--preset", "small", "--set",
                                  "top_k=1"]))
    for name in ("preset", "overrides", "batch_size", "nproc", "esp_placement"):
        assert sim[name] == train[name], name
    out = tmp_path / "t.json"
    assert main(["simulate", "train", "--profile", "schemoe-32gpu", "--nproc", "4",
                 "--set", "num_experts=8", "--compare", "ep,fssdp:static,a2a:pairwise",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == ["ep", "fssdp:static", "a2a:pairwise"]
    assert rows[0]["ratio_to_first"] == 1.0
    cfg = model_preset("tiny", num_experts=8)
    assert rows[0]["spec"]["moe_blocks"] == cfg.moe_layer_ids()
    assert rows[0]["spec"]["tokens"] == 16 * cfg.seq_len
    assert rows[0]["parts_s"]["moe_layers"] == pytest.approx(
        len(cfg.moe_layer_ids()) * rows[0]["moe_layer"]["step_s"])
    assert "tok/s" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="a2a='auto' is tuned"):
        main(["simulate", "train", "--profile", "schemoe-32gpu", "--set", "a2a=auto"])
    with pytest.raises(SystemExit, match="run Parm's schedules"):
        main(["simulate", "train", "--profile", "schemoe-32gpu", "--nproc", "4", "--mp", "2",
              "--compare", "ep"])
    assert main(["simulate", "train", "--profile", "parm-testbed-b", "--nproc", "4", "--mp",
                 "2", "--esp", "2", "--compare", "parm:baseline,parm:s2"]) == 0


def test_the_config_decides_the_strategy_and_unused_flags_are_refused(tmp_path):
    from moeflow.cli import main

    out = tmp_path / "p.json"
    base = ["simulate", "train", "--profile", "parm-testbed-b", "--nproc", "4"]
    assert main([*base, "--mp", "2", "--esp", "2", "--set", "parallel_schedule=s2",
                 "--out", str(out)]) == 0
    assert [r["variant"] for r in json.loads(out.read_text())["results"]] == ["parm:s2"]
    assert main([*base, "--mp", "2", "--out", str(out)]) == 0            # train's default
    assert [r["variant"] for r in json.loads(out.read_text())["results"]] == ["parm:baseline"]
    with pytest.raises(SystemExit, match="--fssdp is read by the fssdp variants"):
        main([*base, "--fssdp", '{"overlap_degree": 2}'])
    with pytest.raises(SystemExit, match="no variant is a Parm one"):
        main(["simulate", "layer", "--nproc", "4", "--profile", "schemoe-32gpu", "--mp", "2"])
