"""Gradient accumulation (``TrainConfig.grad_accum``, ``moeflow train --grad-accum``): the
option's validation, the micro-batches' data, and float64 parity of an accumulated step with
one step on the N-times batch on 2 gloo ranks (EP, Parm ESP, FSSDP; tests/helpers/grad_accum_cases.py)."""

from __future__ import annotations

import pytest
import torch

from moeflow.config import ConfigError, TrainConfig
from moeflow.data import Corpus
from moeflow.launch import launch_local
from moeflow.trainer import micro_batches
from tests.helpers import grad_accum_cases as cases


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_grad_accum_must_be_an_integer_at_least_one(bad):
    with pytest.raises(ConfigError, match=r"^--grad-accum: TrainConfig.grad_accum=.*must be "
                                          r"an integer >= 1"):
        TrainConfig(grad_accum=bad)


def test_cli_flag_reaches_the_config():
    import argparse

    from moeflow.commands import train_command as train_cmd

    parser = argparse.ArgumentParser()
    train_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["train", "--grad-accum", "4", "--batch-size", "2"])
    _, tcfg = train_cmd.configs_from_args(args)
    assert (tcfg.grad_accum, tcfg.batch_size) == (4, 2)
    with pytest.raises(ConfigError, match="--grad-accum"):
        train_cmd.configs_from_args(parser.parse_args(["train", "--grad-accum", "0"]))


def test_micro_batches_split_the_n_times_batch():
    corpus = Corpus.load(None)
    accum = TrainConfig(batch_size=2, grad_accum=3)
    big = TrainConfig(batch_size=6)
    micro = micro_batches(corpus, accum, 16, step=7, dp_rank=1)
    (xb, yb), = micro_batches(corpus, big, 16, step=7, dp_rank=1)
    assert [tuple(x.shape) for x, _ in micro] == [(2, 16)] * 3
    assert torch.equal(torch.cat([x for x, _ in micro]), xb)
    assert torch.equal(torch.cat([y for _, y in micro]), yb)


@pytest.fixture(scope="module")
def results():
    return launch_local(cases.worker, 2, list(cases.LAYOUTS), timeout_s=300)


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["ep", "parm_esp", "fssdp"])
def test_accumulated_step_equals_the_n_times_batch(results, layout):
    for rank in results.values():
        r = rank[layout]
        _close(r["accum"]["grads"], r["big"]["grads"])
        # the cross-entropy statistic is the N-times batch's mean too
        assert r["accum"]["stats"][0] == pytest.approx(r["big"]["stats"][0], rel=1e-12)
        # the gradient synchronisation runs once: no all-reduce more than the big step's
        assert r["accum"]["allreduce_sync"] == r["big"]["allreduce_sync"] > 0
        assert r["accum"]["allreduce_fwd_bwd"] == N_FWD_ALLREDUCES[layout] * cases.N


# all-reduces a layer forward + backward issues itself (Parm: the ESP-AllReduce of the expert
# shards' partial outputs, Section II-B; its backward is the identity): one per MoE layer
N_FWD_ALLREDUCES = {"ep": 0, "parm_esp": cases.CFG.n_layers, "fssdp": 0}


@pytest.mark.multirank
def test_balancing_loss_is_per_micro_batch(results):
    for rank in results.values():
        r = rank["ep_aux"]
        _close(r["accum"]["grads"], r["ref"]["grads"])
        diff = max(float((r["accum"]["grads"][n] - r["big"]["grads"][n]).abs().max())
                   for n in r["big"]["grads"])
        assert diff > 1e-9      # the N-times batch's balancing loss is another function


@pytest.mark.multirank
def test_trainer_updates_router_bias_once_per_step_and_logs_per_step(tmp_path):
    results = launch_local(cases.trainer_worker, 2, str(tmp_path), timeout_s=300)
    for r in results.values():
        acc, big = r["accum"], r["big"]
        # DeepSeek-V3's bias moves by +-speed per update: one update per optimizer step with
        # the loads of all micro-batches equals the N-times batch's (three would not)
        for a, b in zip(acc["bias"], big["bias"]):
            assert torch.equal(a, b) and a.abs().max() > 0
        for n in big["params"]:
            torch.testing.assert_close(acc["params"][n], big["params"][n], rtol=1e-4,
                                       atol=1e-5, msg=n)
        assert [h["step"] for h in acc["history"]] == [1, 2]
        for ha, hb in zip(acc["history"], big["history"]):
            assert ha["loss"] == pytest.approx(hb["loss"], rel=1e-5)
            assert ha["tokens_per_s"] > 0
