"""``moeflow simulate train`` (moeflow/simulate/train_model.py): a whole step of the MoE GPT as the sum
of its dense blocks, every MoE layer's simulated step, the gradient all-reduces and the
optimizer, from ``moeflow train``'s model arguments."""

from __future__ import annotations

import json

import pytest

from moeflow.config import model_preset
from moeflow.errors import ConfigError
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.simulate import LayerSpec, simulate_layer
from moeflow.simulate.costs import KINDS, CostModel
from moeflow.simulate.train_model import OPTIMIZER_BYTES_PER_PARAM, TrainSpec, simulate_train


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
    train = vars(parser.parse_args(["train", "--preset", "small", "--set", "moe.top_k=1"]))
    sim = vars(parser.parse_args(["simulate", "train", "--preset", "small", "--set",
                                  "moe.top_k=1"]))
    for name in ("preset", "overrides", "batch_size", "nproc", "esp_placement", "grad_accum",
                 "recompute"):
        assert sim[name] == train[name], name
    out = tmp_path / "t.json"
    assert main(["simulate", "train", "--profile", "schemoe-32gpu", "--nproc", "4",
                 "--set", "moe.num_experts=8", "--compare", "ep,fssdp:static,a2a:pairwise",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == ["ep", "fssdp:static", "a2a:pairwise"]
    assert rows[0]["ratio_to_first"] == 1.0
    cfg = model_preset("tiny", moe=dict(num_experts=8))
    assert rows[0]["spec"]["moe_blocks"] == cfg.moe_layer_ids()
    assert rows[0]["spec"]["tokens"] == 16 * cfg.seq_len
    assert rows[0]["parts_s"]["moe_layers"] == pytest.approx(
        len(cfg.moe_layer_ids()) * rows[0]["moe_layer"]["step_s"])
    assert "tok/s" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="a2a='auto' is tuned"):
        main(["simulate", "train", "--profile", "schemoe-32gpu", "--set", "moe.a2a=auto"])
    with pytest.raises(SystemExit, match="run Parm's schedules"):
        main(["simulate", "train", "--profile", "schemoe-32gpu", "--nproc", "4", "--mp", "2",
              "--compare", "ep"])
    assert main(["simulate", "train", "--profile", "parm-testbed-b", "--nproc", "4", "--mp",
                 "2", "--esp", "2", "--compare", "parm:baseline,parm:s2"]) == 0


def test_the_config_decides_the_strategy_and_unused_flags_are_refused(tmp_path):
    from moeflow.cli import main

    out = tmp_path / "p.json"
    base = ["simulate", "train", "--profile", "parm-testbed-b", "--nproc", "4"]
    assert main([*base, "--mp", "2", "--esp", "2", "--set", "moe.parallel_schedule=s2",
                 "--out", str(out)]) == 0
    assert [r["variant"] for r in json.loads(out.read_text())["results"]] == ["parm:s2"]
    assert main([*base, "--mp", "2", "--out", str(out)]) == 0            # train's default
    assert [r["variant"] for r in json.loads(out.read_text())["results"]] == ["parm:baseline"]
    with pytest.raises(SystemExit, match="--fssdp is read by the fssdp variants"):
        main([*base, "--fssdp", '{"overlap_degree": 2}'])
    with pytest.raises(SystemExit, match="no variant is a Parm one"):
        main(["simulate", "layer", "--nproc", "4", "--profile", "schemoe-32gpu", "--mp", "2"])


def _spec(**kw) -> TrainSpec:
    return TrainSpec(**{**dict(tokens=512, seq_len=128, d_model=64, n_heads=4, d_ff=256,
                               vocab_size=256, n_layers=4, moe_blocks=(1, 3), dense_params=1000,
                               expert_params=500, dp_size=4, expert_dp_size=2,
                               ranks_per_node=4), **kw})


def test_grad_accum_repeats_the_micro_batch_and_syncs_once():
    c = _costs()
    layer = simulate_layer(LayerSpec(tokens=512, d_model=64, d_expert=128, num_experts=8,
                                     top_k=2, capacity_factor=1.25, ranks_per_node=4), c)
    one = simulate_train(_spec(), c, {1: layer, 3: layer})
    three = simulate_train(_spec(grad_accum=3), c, {1: layer, 3: layer})
    p1, p3 = one["parts_s"], three["parts_s"]
    for k in ("attention", "dense_ffn", "embed_head", "moe_layers"):
        assert p3[k] == pytest.approx(3 * p1[k]), k
    # one gradient all-reduce (dense + experts) and one optimizer step per optimizer step
    assert p3["grad_sync"] == p1["grad_sync"] > 0 and p3["optimizer"] == p1["optimizer"]
    assert p3["grad_accumulate"] == pytest.approx(2 * (1e-6 + 1e-11 * 12 * 1500))
    assert "grad_accumulate" not in p1
    assert three["step_s"] == pytest.approx(3 * one["micro_batch_s"] + p3["grad_accumulate"]
                                            + p1["grad_sync"] + p1["optimizer"])
    assert three["tokens_per_s"] == pytest.approx(3 * 512 * 4 / three["step_s"])


def _names(res: dict, phase: str, rank: int = 0) -> list[str]:
    return sorted(t["task"] for t in res["tasks"] if t["rank"] == rank and t["phase"] == phase)


def test_recompute_adds_exactly_the_recomputed_tasks():
    from moeflow.simulate.fssdp_model import FSSDPSpec
    from moeflow.simulate.parm_model import ParmSpec, simulate_parm

    c = _costs()
    base = dict(tokens=512, d_model=64, d_expert=128, num_experts=8, top_k=2,
                capacity_factor=1.25, ranks_per_node=4, pipeline_degree=2, schedule="optsche")
    none, act, full = (simulate_layer(LayerSpec(**base, recompute=m), c)
                       for m in ("none", "moe_act", "full"))
    e_fwd = sum(t["end_s"] - t["start_s"] for t in none["tasks"]
                if t["rank"] == 0 and t["phase"] == "forward" and t["task"].startswith("E^"))
    # moe_act: the same tasks and collectives; backward E longer by the experts' forward
    for r in (act, full):
        assert _names(r, "backward") == _names(none, "backward")
    assert _names(act, "forward") == _names(none, "forward") and not _names(act, "recompute")
    e_bwd = lambda r: sum(t["end_s"] - t["start_s"] for t in r["tasks"]      # noqa: E731
                          if t["rank"] == 0 and t["phase"] == "backward"
                          and t["task"].startswith("E^"))
    assert e_bwd(act) - e_bwd(none) == pytest.approx(e_fwd)
    assert act["recompute_s"] == 0.0
    # full: the forward once more, minus the count exchange (the plan record's counts)
    assert _names(full, "recompute") == [n for n in _names(none, "forward") if n != "counts"]
    assert "counts" in _names(none, "forward")
    assert e_bwd(full) == pytest.approx(e_bwd(act)) and full["recompute_s"] > 0
    # FSSDP: the rerun's spAG of the recorded P' replaces HECATE-RM's backward spAG
    seq = {**base, "pipeline_degree": 1, "schedule": "sequential"}
    plain = simulate_layer(LayerSpec(**seq), c, None,
                           FSSDPSpec(materialize="static", rematerialize=True))
    assert sorted((t["phase"], t["task"]) for t in plain["tasks"] if t["rank"] == 0
                  and t["task"].startswith("sp")) == [("backward", "spAG"), ("backward", "spRS"),
                                                      ("forward", "spAG")]
    for rm in (True, False):
        f = simulate_layer(LayerSpec(**seq, recompute="full"), c, None,
                           FSSDPSpec(materialize="static", rematerialize=rm))
        got = [(t["phase"], t["task"]) for t in f["tasks"] if t["rank"] == 0
               and t["task"].startswith("sp")]
        assert sorted(got) == [("backward", "spRS"), ("forward", "spAG"),
                               ("recompute", "spAG")], rm
    # Parm: the same rules over its steps
    pbase = dict(tokens=512, d_model=64, d_expert=128, num_experts=8, top_k=2,
                 capacity_factor=1.25, mp=2, ep=2, ranks_per_node=4)
    pn, pa, pf = (simulate_parm(ParmSpec(**pbase, recompute=m), c)
                  for m in ("none", "moe_act", "full"))
    assert pa["collectives"] == pn["collectives"]
    assert _names(pa, "backward").count("E") == 2 * _names(pn, "backward").count("E")
    fwd = [x for x in pn["collectives"][0] if x["phase"] == "forward"]
    rec = [x for x in pf["collectives"][0] if x["phase"] == "recompute"]
    assert [x["name"] for x in rec] == [x["name"] for x in fwd if x["name"] != "counts"]
    assert any(x["name"] == "counts" for x in fwd)


def test_full_recompute_reruns_the_blocks_forward_not_the_head():
    c = _costs()
    T, M, S, F, H = 512, 64, 128, 256, 4
    g = lambda f: 1e-6 + 1e-11 * f                                     # noqa: E731
    from moeflow.simulate.train_model import dense_seconds
    parts = dense_seconds(_spec(recompute="full"), c)
    att = 4 * (g(8 * T * M * M) + g(4 * T * S * M)
               + g(4 * T * M * 4 + 2 * T * H * S * 4 + 6 * T * M * 4))
    assert parts["recompute"] == pytest.approx(att + 2 * (g(4 * T * M * F) + g(2 * T * F * 4)))
    assert {k: v for k, v in parts.items() if k != "recompute"} == dense_seconds(_spec(), c)
    # with MP the rerun forward's GEMMs are split and its all-reduces (Megatron's g: one per
    # block and one per dense FFN) are issued again
    tp = dense_seconds(_spec(recompute="full", mp=2), c)
    att2 = 4 * (g(8 * T * M * M / 2) + g(4 * T * S * M / 2)
                + g(4 * T * M * 4 + T * H * S * 4 + 6 * T * M * 4))
    ffn2 = 2 * (g(2 * T * M * F) + g(T * F * 4))
    assert tp["recompute"] == pytest.approx(att2 + ffn2 + (4 + 2) * (1e-4 + 1e-9 * T * M * 4))
    assert tp["mp_all_reduce"] == dense_seconds(_spec(mp=2), c)["mp_all_reduce"]
    with pytest.raises(ConfigError, match="TrainSpec.recompute='some'"):
        _spec(recompute="some")
    from moeflow.config import TRAIN_RECOMPUTES
    from moeflow.simulate.layer_model import RECOMPUTES
    assert sorted(RECOMPUTES) == sorted(TRAIN_RECOMPUTES)     # the simulator's copy of them
