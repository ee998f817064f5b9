"""``moeflow simulate train --pp`` (moeflow/simulate/pipeline_order.py, pipeline_model.py,
pipeline_stages.py, moeflow/commands/simulate_pipeline.py): torch's own action order per
schedule, the step as a dependency graph over it (the bubble falls out: GPipe / 1F1B's
``(p - 1) / (m + p - 1)`` with equal stages and free sends; hand-checked timelines of the
two-stage-per-rank schedules and of an overlapped pair), and the refusals of ``moeflow train
--pp``."""

from __future__ import annotations

import json

import pytest

from moeflow.errors import ConfigError
from moeflow.pipeline_parallel.pipeline_schedules import (SCHEDULE_CLASSES, stage_ids,
                                                          stages_per_rank)
from moeflow.simulate.pipeline_model import StageTimes, overlapped_pair_s, simulate_pipeline
from moeflow.simulate.pipeline_order import torch_order


def _order(schedule: str, pp: int, m: int):
    return torch_order(SCHEDULE_CLASSES[schedule], pp, m, stages_per_rank(schedule))


def _free_sends(pp: int) -> dict:
    return {(a, b): 0.0 for a in range(pp) for b in range(pp) if a != b}


@pytest.mark.parametrize("schedule", sorted(SCHEDULE_CLASSES))
def test_torch_order_runs_every_chunk_once_on_the_trainers_ranks(schedule):
    pp, m = 2, 4
    order = _order(schedule, pp, m)
    n = pp * stages_per_rank(schedule)
    seen = {}
    for rank, acts in order.items():
        for a in acts:
            for x in (a.sub or (a,)):
                assert x.stage in stage_ids(schedule, pp, rank), (rank, x)
                key = ("F" if x.kind == "F" else "W" if x.kind == "W" else "I", x.stage, x.mb)
                seen[key] = seen.get(key, 0) + 1
                if x.kind == "B":            # a full backward is I and W at once
                    seen[("W", x.stage, x.mb)] = seen.get(("W", x.stage, x.mb), 0) + 1
    want = {(k, s, mb): 1 for k in ("F", "I", "W") for s in range(n) for mb in range(m)}
    assert seen == want


def test_dualpipev_order_has_overlapped_pairs():
    order = _order("dualpipev", 2, 4)
    assert any(a.kind == "FB" for acts in order.values() for a in acts)
    assert all(a.kind != "FB" for acts in _order("zbv", 2, 4).values() for a in acts)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_equal_stages_free_sends_give_the_textbook_bubble(schedule, pp, m):
    # GPipe (Huang et al. 2019 Section 2.2), 1F1B (Narayanan et al. 2021 Section 2.2.1):
    # (p - 1) / (m + p - 1) on every rank, whatever F and B are
    stages = [StageTimes(forward_s=1.0, input_s=2.0)] * pp
    res = simulate_pipeline(_order(schedule, pp, m), stages, _free_sends(pp))
    assert res["span_s"] == pytest.approx((m + pp - 1) * 3.0)
    for r in res["ranks"]:
        assert r["busy_s"] == pytest.approx(3.0 * m)
        assert r["bubble"] == pytest.approx((pp - 1) / (m + pp - 1))


def test_a_send_delays_the_pipeline_by_the_transfers_on_its_path():
    # GPipe on 2 ranks, 2 micro-batches, F = 1, B = 2, a send of 0.5 each way: rank 1 starts
    # F0 at 1.5, F1 at 2.5 (rank 0 sent F1's output at 2, it arrives at 2.5), B0 3.5-5.5,
    # B1 5.5-7.5; rank 0 gets B0's gradient at 6, B1's at 8: B0 6-8, B1 8-10
    stages = [StageTimes(1.0, 2.0)] * 2
    res = simulate_pipeline(_order("gpipe", 2, 2), stages, {(0, 1): 0.5, (1, 0): 0.5})
    assert res["span_s"] == pytest.approx(10.0)
    assert res["ranks"][0]["busy_s"] == pytest.approx(6.0)
    assert res["ranks"][1]["idle_s"] == pytest.approx(10.0 - 6.0)
    assert res["ranks"][0]["send_s"] == pytest.approx(1.0)


def test_overlapped_pair_hides_one_halfs_exchange_behind_the_others_compute():
    # F: c1 x2 c1, B: c2 x2 c2. F computes 0-1, issues its exchange (1-3), hands over; B
    # computes 1-3, issues its exchange (3-5: the lane is free at 3), hands back; F waits for
    # its exchange (done at 3), computes 3-4, finishes; B waits for its exchange until 5,
    # computes 5-7.
    assert overlapped_pair_s((("c", 1.0), ("x", 2.0), ("c", 1.0)),
                             (("c", 2.0), ("x", 2.0), ("c", 2.0))) == pytest.approx(7.0)
    # one after the other it would be 4 + 6 = 10; without exchanges, the sum of the compute
    assert overlapped_pair_s((("c", 1.0),), (("c", 2.0),)) == pytest.approx(3.0)
    # the exchanges share one lane: two exchanges of 3 back to back
    assert overlapped_pair_s((("x", 3.0), ("c", 1.0)),
                             (("x", 3.0), ("c", 1.0))) == pytest.approx(7.0)


_LAYOUT = ["--profile", "schemoe-32gpu", "--nodes", "2", "--ranks-per-node", "2", "--nproc", "4"]


def _run(tmp_path, *extra) -> dict:
    from moeflow.cli import main

    out = tmp_path / "p.json"
    assert main(["simulate", "train", *_LAYOUT, "--batch-size", "4", "--grad-accum", "4",
                 "--pp", "2", "--out", str(out), "--out-summary", *extra]) == 0
    return json.loads(out.read_text())["results"][0]


def test_cli_predicts_a_pipeline_step_on_the_trainers_layout(tmp_path, capsys):
    across = _run(tmp_path, "--pp-schedule", "1f1b")
    assert "bubble" in capsys.readouterr().out
    assert across["stage_ranks"] == 2 and across["stage_ranks_per_node"] == 2
    assert across["step_s"] == pytest.approx(across["schedule_s"] + across["after_schedule_s"])
    assert across["tokens_per_s"] == pytest.approx(4 * 128 * 2 * 4 / across["step_s"])
    assert [s["blocks"] for s in across["stages"]] == [[0, 1], [2, 3]]
    assert 0 < across["bubble_mean"] < 1
    within = _run(tmp_path, "--pp-schedule", "1f1b", "--pp-layout", "within-nodes")
    # across-nodes: the sends cross the nodes and the all-to-all stays in a node; within-nodes
    # the other way round (the profile's inter-node link is the slower one)
    assert across["sends_s"]["0->1"] > within["sends_s"]["0->1"]
    assert across["moe_layer"]["comm_s"] < within["moe_layer"]["comm_s"]
    v = _run(tmp_path, "--pp-schedule", "dualpipev")
    assert [s["blocks"] for s in v["stages"]] == [[0], [1], [2], [3]]
    assert v["overlap"] is True and v["variant"].endswith("overlap=on")
    # stages with MoE layers compute their weight gradients in the input step
    assert v["stages"][1]["weight_s"] == 0 and v["stages"][2]["weight_s"] > 0
    off = _run(tmp_path, "--pp-schedule", "dualpipev", "--pp-overlap", "off")
    assert off["overlap"] is False and off["step_s"] > v["step_s"]


@pytest.mark.parametrize("extra,flag", [
    (["--recompute", "full"], "--recompute"),
    (["--pp-schedule", "dualpipev", "--grad-accum", "2"], "--grad-accum"),
    (["--pp", "3"], "--pp 3"),
    (["--pp-overlap", "on"], "--pp-overlap"),
    (["--set", "moe.placement=fssdp"], "moe.placement=fssdp"),
    (["--compare", "ep"], "--compare"),
    (["--ep-size", "1"], "--ep-size 1"),
    (["--pp", "4", "--pp-schedule", "zbv"], "n_layers=4"),
])
def test_what_moeflow_train_refuses_under_pp_is_refused(extra, flag):
    from moeflow.cli import main

    with pytest.raises(SystemExit, match=flag):
        main(["simulate", "train", *_LAYOUT, "--batch-size", "4", "--grad-accum", "4",
              "--pp", "2", *extra])


def test_interleaved_1f1b_by_hand():
    # pp 2, m 2, stages 0, 2 on rank 0 and 1, 3 on rank 1 (torch's loop), F = 1, B = 2:
    # rank 0: 0F0 0-1, 0F1 1-2, 2F0 2-3, 2F1 3-4, 2B0 6-8, 2B1 9-11, 0B0 11-13, 0B1 13-15
    # rank 1: 1F0 1-2, 1F1 2-3, 3F0 3-4, 3B0 4-6, 3F1 6-7, 3B1 7-9, 1B0 9-11, 1B1 11-13
    order = _order("interleaved-1f1b", 2, 2)
    assert [str(a) for a in order[0]] == "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1".split()
    assert [str(a) for a in order[1]] == "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1".split()
    res = simulate_pipeline(order, [StageTimes(1.0, 2.0)] * 4, _free_sends(2))
    assert res["span_s"] == pytest.approx(15.0)
    ends = {(a["rank"], a["action"]): a["end_s"] for a in res["actions"]}
    assert ends[(0, "2B0")] == pytest.approx(8.0) and ends[(1, "1B1")] == pytest.approx(13.0)
    assert [r["busy_s"] for r in res["ranks"]] == pytest.approx([12.0, 12.0])
    assert [r["bubble"] for r in res["ranks"]] == pytest.approx([0.2, 0.2])


def test_zbv_by_hand():
    # pp 2, m 4, the V: stages 0, 3 on rank 0 and 1, 2 on rank 1; F = I = W = 1. Worked out
    # action by action in torch's order: rank 0 never waits (0I0 10-11: 1I0 ended at 9;
    # 0I1 15-16: 1I1 ended at 15; 0I3 22-23: 1I3 ended at 22; 0W3 ends at 24);
    # rank 1 idles 0-1, then 2I2 17-18 (3I2 ended at 14, rank 1 free at 17) ... 1W3 24-25
    order = _order("zbv", 2, 4)
    assert [str(a) for a in order[0]][:10] == \
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3".split()
    res = simulate_pipeline(order, [StageTimes(1.0, 1.0, 1.0)] * 4, _free_sends(2))
    assert res["span_s"] == pytest.approx(25.0)
    ends = {(a["rank"], a["action"]): a["end_s"] for a in res["actions"]}
    assert ends[(0, "0W3")] == pytest.approx(24.0)
    assert ends[(1, "2I2")] == pytest.approx(18.0)     # waits for 3I2 (14) and rank 1 (17)
    assert [r["busy_s"] for r in res["ranks"]] == pytest.approx([24.0, 24.0])


def test_dualpipev_by_hand_without_overlap():
    # pp 2, m 4; F = 1, full backward 2 (I = 2, W = 0: a stage with MoE layers), a pair = 3
    order = _order("dualpipev", 2, 4)
    assert [str(a) for a in order[0]] == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3&3B1) (3F2&0B0) 3B2 (3F3&0B1) 3B3 0I2 0W2 0I3 0W3"
        .split())
    assert [str(a) for a in order[1]] == (
        "1F0 2F0 1F1 2F1 1F2 2B0 (2F2&1B0) (1F3&2B1) (2F3&1B1) 2B2 1B2 2I3 1I3 2W3 1W3"
        .split())
    res = simulate_pipeline(order, [StageTimes(1.0, 2.0, 0.0)] * 4, _free_sends(2))
    # rank 1: 2B0 6-8, (2F2&1B0) 8-11, (1F3&2B1) 11-14 (0F3 arrived at 10), (2F3&1B1) 14-17,
    # 2B2 17-19, 1B2 19-21, 2I3 22-24 (3B3 ends 22), 1I3 24-26; rank 0: 0I3 26-28
    ends = {(a["rank"], a["action"]): a["end_s"] for a in res["actions"]}
    assert ends[(1, "(1F3&2B1)")] == pytest.approx(14.0)
    assert ends[(0, "3B3")] == pytest.approx(22.0)
    assert res["span_s"] == pytest.approx(28.0)
    assert [r["bubble"] for r in res["ranks"]] == pytest.approx([1 - 24 / 28] * 2)
    with pytest.raises(ConfigError, match="segments"):
        simulate_pipeline(order, [StageTimes(1.0, 2.0, 0.0)] * 4, _free_sends(2), overlap=True)


def test_1f1b_order_is_the_loop_torch_runs():
    # Schedule1F1B._step_microbatches: min(m, p - r) warm-up forwards, then B and F in turn
    order = _order("1f1b", 2, 4)
    assert [str(a) for a in order[0]] == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3".split()
    assert [str(a) for a in order[1]] == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3".split()
    assert [str(a) for a in _order("gpipe", 2, 2)[1]] == "1F0 1F1 1B0 1B1".split()
