"""Pipeline parallelism (``moeflow train --pp N --pp-schedule S``, moeflow.pipeline_parallel): the
options' validation and what they refuse, the stage split and placement, and float64 parity
of PP 2 x EP 2 on 4 gloo ranks with PP 1 x EP 2 on 2 ranks, the same function on the same
global batch (tests/helpers/pipeline_cases.py), for every schedule."""

from __future__ import annotations

import pytest
import torch

from moeflow.config import ConfigError, ModelConfig, TrainConfig
from moeflow.launch import launch_local
from moeflow.pipeline_parallel.layout_checks import check_pipeline
from moeflow.pipeline_parallel.pipeline_schedules import stage_ids
from moeflow.pipeline_parallel.split import stage_blocks
from tests.helpers import pipeline_cases as cases

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev")


@pytest.mark.parametrize("kw, match", [
    (dict(pp=0), r"^--pp: TrainConfig.pp=0 is invalid"),
    (dict(pp=2, pp_schedule="zb"), r"^--pp-schedule: TrainConfig.pp_schedule='zb'.*dualpipev"),
    (dict(pp=2, grad_accum=1), r"^--grad-accum: .*needs at least 2 micro-batches"),
    (dict(pp=2, grad_accum=3, pp_schedule="dualpipev"), r"at least 4 micro-batches"),
    (dict(pp=2, grad_accum=2, eval_batches=3), r"^--eval-batches: .*multiple of 2"),
    (dict(pp=2, grad_accum=2, dense_shard="fsdp"), r"^--dense-shard with --pp: .*replicate"),
    (dict(pp=2, grad_accum=2, mp_size=2), r"^--mp with --pp: "),
    (dict(pp=2, grad_accum=2, esp_size=2), r"^--esp with --pp: "),
    (dict(pp=2, grad_accum=2, recompute="full"), r"^--recompute with --pp: "),
    (dict(pp=2, grad_accum=4, pp_overlap="yes"), r"^--pp-overlap: .*auto, on, off"),
    (dict(pp=2, grad_accum=4, pp_overlap="on"), r"^--pp-overlap: .*only --pp-schedule dualpipev"),
])
def test_pipeline_options_are_validated(kw, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(eval_batches=kw.pop("eval_batches", 4), **kw)


def test_model_checks_name_the_flags():
    tcfg = TrainConfig(pp=2, grad_accum=4, pp_schedule="zbv", eval_batches=4)
    with pytest.raises(ConfigError, match=r"n_layers=2 is invalid with 4 pipeline stages"):
        check_pipeline(ModelConfig(n_layers=2), tcfg, 4)
    with pytest.raises(ConfigError, match=r"--pp 2 is invalid with 3 ranks"):
        check_pipeline(ModelConfig(n_layers=4), tcfg, 3)
    with pytest.raises(ConfigError, match=r"--ep-size 4 is invalid with --pp 2"):
        check_pipeline(ModelConfig(n_layers=4), TrainConfig(pp=2, grad_accum=2, ep_size=4,
                                                            eval_batches=2), 4)
    with pytest.raises(ConfigError, match=r"moe.placement=fssdp with --pp 2"):
        check_pipeline(ModelConfig(n_layers=4, moe={"placement": "fssdp"}), tcfg, 4)
    with pytest.raises(ConfigError, match=r"moe.recompute=moe_act with --pp 2"):
        check_pipeline(ModelConfig(n_layers=4, moe={"recompute": "moe_act"}), tcfg, 4)
    with pytest.raises(ConfigError, match=r"moe.a2a=auto with --pp 2: the auto-tuner"):
        check_pipeline(ModelConfig(n_layers=4, moe={"a2a": "auto"}), tcfg, 4)
    assert check_pipeline(ModelConfig(n_layers=4), tcfg, 4) == 2


def test_cli_flags_reach_the_config():
    import argparse

    from moeflow.commands import train_command as train_cmd

    parser = argparse.ArgumentParser()
    train_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["train", "--pp", "2", "--pp-schedule", "zbv", "--grad-accum",
                              "4", "--eval-batches", "4"])
    mcfg, tcfg = train_cmd.configs_from_args(args)
    assert (tcfg.pp, tcfg.pp_schedule, tcfg.grad_accum, tcfg.pp_overlap) == (2, "zbv", 4, "auto")
    args = parser.parse_args(["train", "--pp", "2", "--pp-schedule", "dualpipev", "--grad-accum",
                              "4", "--eval-batches", "4", "--pp-overlap", "off"])
    assert train_cmd.configs_from_args(args)[1].pp_overlap == "off"
    # --pp runs fixed exchange settings (the tuner's barriers span the world), not "auto"
    assert "auto" not in (mcfg.moe.a2a, mcfg.moe.schedule, mcfg.moe.pipeline_degree)
    check_pipeline(mcfg, tcfg, 4)
    with pytest.raises(ConfigError, match="--pp-schedule"):
        train_cmd.configs_from_args(parser.parse_args(["train", "--pp", "2", "--pp-schedule",
                                                       "x", "--grad-accum", "2"]))


def test_blocks_split_evenly_and_stages_sit_in_a_loop_or_a_v():
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]
    assert [stage_ids("1f1b", 2, r) for r in range(2)] == [[0], [1]]
    assert [stage_ids("interleaved-1f1b", 2, r) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids(s, 2, r) for s in ("zbv", "dualpipev") for r in range(2)] == \
        [[0, 3], [1, 2]] * 2


@pytest.fixture(scope="module")
def reference():
    res = launch_local(cases.reference_worker, 2, timeout_s=300)
    return {r["dp_rank"]: r for r in res.values()}


def _check_schedule(reference, schedule: str) -> dict:
    res = launch_local(cases.pipeline_worker, 4, [schedule], timeout_s=300)
    seen: dict[int, set] = {0: set(), 1: set()}
    for rank_res in res.values():
        r = rank_res[schedule]
        ref = reference[r["dp_rank"]]
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref["grads"][name], rtol=1e-9, atol=1e-12,
                                       msg=f"{schedule}: {name}")
        seen[r["dp_rank"]] |= set(r["grads"])
        # [ce, aux, balance]: the balancing loss of every stage is counted, none twice
        assert r["stats"] == pytest.approx(ref["stats"], rel=1e-12, abs=1e-15)
        assert r["norm"] == pytest.approx(ref["norm"], rel=1e-6)   # a float32 norm
        assert r["val"] == pytest.approx(ref["val"], rel=1e-12)
    for dp, names in seen.items():          # every parameter has its gradient on some stage
        assert names == set(reference[dp]["grads"]), schedule
    return {rank: rank_res[schedule]["a2a"] for rank, rank_res in res.items()}


@pytest.mark.multirank
def test_1f1b_equals_the_unpipelined_step(reference):
    _check_schedule(reference, "1f1b")


@pytest.mark.multirank
@pytest.mark.slow
def test_overlapped_dualpipev_equals_the_unpipelined_step(reference):
    """DualPipe's overlapped pairs (DeepSeek-V3 Section 3.2.1): the same step, with
    exchanges that handed the turn to the other micro-batch, on every rank; the clock's
    exposed time is part of the exchanges' total."""
    a2a = _check_schedule(reference, "dualpipev:on")
    for rank, t in a2a.items():
        # 4 exchanges per MoE layer and micro-batch (dispatch, combine; forward, backward);
        # each pipeline rank holds one MoE layer (blocks 1 and 3 of stages 0-3 in a V)
        assert t["a2a_count"] == 4 * cases.N, rank
        assert t["a2a_handed"] > 0, rank
        assert 0 <= t["a2a_exposed_s"] <= t["a2a_total_s"], rank


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s not in ("1f1b", "dualpipev")]
                         + ["dualpipev:off"])     # dualpipev (overlapped): the test above
def test_schedule_equals_the_unpipelined_step(reference, schedule):
    _check_schedule(reference, schedule)
