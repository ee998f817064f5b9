"""``moeflow bench pipeline``'s parts without ranks: the theoretical bubble of each schedule
(moeflow.bench.pipeline_bubble) against the closed forms of its paper, the ``--configs``
list and the batch of each configuration (moeflow.bench.pipeline_cases), and the record and
table made from per-rank samples (moeflow.bench.pipeline_bench.summarise)."""

from __future__ import annotations

import argparse

import pytest
import torch

from moeflow.bench.pipeline_bench import format_table, summarise
from moeflow.bench.pipeline_bubble import bubble_share, bubble_time
from moeflow.bench.pipeline_cases import PipelineCase, case_train_config, parse_cases
from moeflow.errors import ConfigError


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 8), (3, 5)])
def test_bubble_matches_the_papers_closed_forms(p, m):
    # GPipe / 1F1B: (p - 1) / (m + p - 1); interleaved with v = 2: (p - 1) / (v m + p - 1)
    for sched in ("gpipe", "1f1b"):
        assert bubble_share(sched, p, m, 1.0, 2.0) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_share("interleaved-1f1b", p, m, 1.0, 2.0) == \
        pytest.approx((p - 1) / (2 * m + p - 1))
    # zero bubble where W fills it: ZB1P (p - 1)(F + B - 2W) = 0 at F = B = W
    assert bubble_share("zbv", p, m, 1.0, 1.0, 1.0) == 0.0
    assert bubble_time("zbv", p, 1.0, 2.0, 0.5) == pytest.approx((p - 1) * 2.0)
    # DualPipe (DeepSeek-V3 Table 2) on PP = 2p stages: (p - 1)(F&B + B - 3W)
    assert bubble_time("dualpipev", p, 1.0, 2.0, 0.0, fb=2.5) == pytest.approx((p - 1) * 4.5)
    assert bubble_time("dualpipev", p, 1.0, 2.0) == pytest.approx((p - 1) * 5.0)
    assert bubble_time("dualpipev", p, 1.0, 1.0, 1.0) == 0.0
    share = bubble_share("dualpipev", p, m, 1.0, 2.0, 0.0, fb=2.5)
    assert share == pytest.approx((p - 1) * 4.5 / ((p - 1) * 4.5 + 2 * m * 3.0))


def test_chunk_timers_count_overlapping_chunks_once():
    import threading
    import time

    from moeflow.bench.pipeline_bench import _Timers

    class _Stage:
        def forward_one_chunk(self):
            time.sleep(0.2)

        def backward_one_chunk(self):
            time.sleep(0.2)

    stage, timers = _Stage(), _Timers(torch.device("cpu"))
    timers.wrap(stage, "forward_one_chunk", "forward")
    timers.wrap(stage, "backward_one_chunk", "backward")
    pair = [threading.Thread(target=stage.forward_one_chunk),
            threading.Thread(target=stage.backward_one_chunk)]
    for t in pair:
        t.start()
    for t in pair:
        t.join()
    assert timers.s["forward"] >= 0.2 and timers.s["backward"] >= 0.2
    assert 0.2 <= timers.s["compute"] < 0.35      # the overlapping spans once
    stage.forward_one_chunk()
    assert 0.4 <= timers.s["compute"] < 0.6


def test_bubble_refusals():
    with pytest.raises(ConfigError, match="--pp-schedule 'x' has no bubble formula"):
        bubble_time("x", 2, 1.0, 1.0)
    with pytest.raises(ConfigError, match="micro-batches m=0"):
        bubble_share("1f1b", 2, 0, 1.0, 1.0)
    assert bubble_share("1f1b", 1, 4, 1.0, 1.0) == 0.0


def test_configs_are_parsed_and_refused_by_name():
    cases = parse_cases("ep, pp2:1f1b,pp2:zbv:within-nodes,pp2:dualpipev:overlap=off,"
                        "pp2:dualpipev:within-nodes:overlap=on")
    assert cases == [PipelineCase("ep"), PipelineCase("pp2:1f1b", 2, "1f1b"),
                     PipelineCase("pp2:zbv:within-nodes", 2, "zbv", "within-nodes"),
                     PipelineCase("pp2:dualpipev:overlap=off", 2, "dualpipev", overlap="off"),
                     PipelineCase("pp2:dualpipev:within-nodes:overlap=on", 2, "dualpipev",
                                  "within-nodes", "on")]
    assert case_train_config(cases[3], 4, 16, 4, 3).pp_overlap == "off"
    for bad in ("pp1:1f1b", "pp2:zb", "pp2:1f1b:diagonal", "dp", "pp2:dualpipev:overlap=x"):
        with pytest.raises(ConfigError, match=rf"^--configs has '{bad}'"):
            parse_cases(bad)
    with pytest.raises(ConfigError, match="each once"):
        parse_cases("ep,ep")


def test_every_configuration_runs_the_same_global_batch():
    ep = case_train_config(PipelineCase("ep"), 4, 16, 4, 3)
    pp = case_train_config(PipelineCase("pp2:1f1b", 2, "1f1b"), 4, 16, 4, 3)
    assert (ep.batch_size * ep.grad_accum * 4, ep.pp) == (16, 1)
    assert (pp.batch_size, pp.grad_accum, pp.pp) == (2, 4, 2)
    assert pp.batch_size * pp.grad_accum * 2 == 16
    with pytest.raises(ConfigError, match=r"^--global-batch 12 is invalid for pp2:1f1b"):
        case_train_config(PipelineCase("pp2:1f1b", 2, "1f1b"), 4, 12, 4, 3)


def test_cli_refuses_before_the_ranks_start():
    from moeflow.commands import bench_command
    from moeflow.commands.bench_pipeline import bench_configs

    parser = argparse.ArgumentParser()
    bench_command.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "pipeline", "--configs", "ep,pp2:1f1b:within-nodes"])
    mcfg, cases = bench_configs(args, 4, 2)
    assert [c.layout for c in cases] == ["across-nodes", "within-nodes"]
    args = parser.parse_args(["bench", "pipeline", "--configs", "pp2:1f1b:within-nodes",
                              "--global-batch", "24"])
    with pytest.raises(ConfigError, match=r"--pp-layout within-nodes cannot be placed"):
        bench_configs(args, 6, 3)
    args = parser.parse_args(["bench", "pipeline", "--micro-batches", "0"])
    with pytest.raises(ConfigError, match=r"^--micro-batches 0 is invalid"):
        bench_configs(args, 4, 4)
    args = parser.parse_args(["bench", "pipeline", "--out", "no/such/folder/pp.json"])
    with pytest.raises(ConfigError, match=r"^--out no/such/folder/pp.json: the folder"):
        bench_configs(args, 4, 4)


def _sample(step, fwd, bwd, sched, a2a=0.1, exposed=0.05):
    return {"step_s": step, "a2a_s": a2a, "a2a_exposed_s": exposed,
            "clock_total_s": 2 * a2a, "clock_exposed_s": exposed, "clock_count": 8.0,
            "clock_handed": 0.0,
            "chunk_s": {"forward": fwd, "backward": bwd, "weight": 0.0, "schedule": sched},
            "chunk_n": {"forward": 4, "backward": 4, "weight": 0, "schedule": 1}}


def test_record_from_per_rank_samples():
    case = PipelineCase("pp2:1f1b", 2, "1f1b")
    tcfg = case_train_config(case, 4, 16, 4, 3)
    mem = {"state_bytes": 10, "step_peak_bytes": 5, "peak_bytes": 15}
    # 2 rounds; rank 1 is the slower in round 0 (the slowest rank's step counts)
    ranks = [{"memory": mem, "samples": [_sample(1.0, 0.4, 0.4, 1.0),
                                         _sample(2.0, 0.4, 0.4, 1.0)]},
             {"memory": mem, "samples": [_sample(1.5, 0.3, 0.3, 1.0),
                                         _sample(1.0, 0.3, 0.3, 1.0)]}]
    rec = summarise(case, tcfg, ranks, tokens=3000, micro=4)
    assert rec["step_s"] == [1.5, 2.0]
    assert rec["tokens_per_s"] == {"median": 1750.0, "min": 1500.0, "max": 2000.0}
    b = rec["bubble"]
    assert [r["median"] for r in b["measured_per_rank"]] == pytest.approx([0.2, 0.4])
    assert b["measured_mean"] == pytest.approx(0.3)
    assert b["chunk_mean_s"]["forward"] == pytest.approx((0.4 + 0.4 + 0.3 + 0.3) / 16)
    assert b["theory"] == pytest.approx(1 / 5)
    assert rec["a2a_per_rank"][0]["a2a_exposed_s"]["median"] == 0.05
    assert rec["a2a_per_rank"][0]["clock_total_s"]["median"] == 0.2
    assert rec["a2a_hidden_share"] == pytest.approx(1 - 0.05 / 0.2)
    assert rec["samples_per_rank"][1] == ranks[1]["samples"]
    ep = summarise(PipelineCase("ep"), case_train_config(PipelineCase("ep"), 4, 16, 4, 3),
                   ranks, tokens=3000, micro=4)
    assert "bubble" not in ep and ep["schedule"] is None
    # an overlapped pair's chunks run at once: the union of their spans is the compute
    for r in ranks:
        for smp in r["samples"]:
            smp["chunk_s"]["compute"] = 0.5
    assert summarise(case, tcfg, ranks, tokens=3000, micro=4)["bubble"]["measured_mean"] == \
        pytest.approx(0.5)
    table = format_table({"cases": [rec, ep]})
    assert "0.30/0.20" in table and "1750" in table and "0.75" in table
