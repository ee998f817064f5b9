"""FSDP2 on the dense part (``TrainConfig.dense_shard="fsdp"``, ``moeflow.parallel.fsdp``):
the option's validation, and float64 parity with one unsharded process on 4 gloo ranks after
AdamW steps with clipping, with checkpoints FSDP2 on -> off -> on between them
(tests/helpers/fsdp_cases.py). The default run covers EP with experts replicated over two
EP groups (the expert gradients still all-reduced by sync_gradients) and Parm's tensor
parallelism (MP 2, S1) with FSDP2 over each MP rank's data-parallel pair; EP over all 4 ranks,
HECATE's FSSDP, Parm's expert sharding (ESP 2), activation recomputation, and MP 2 with the
baseline schedule and with ESP 2 are slow variants."""

from __future__ import annotations

import argparse

import pytest
import torch

from moeflow import checkpoint
from moeflow.config import ConfigError, TrainConfig
from moeflow.launch import launch_local
from moeflow.parallel.fsdp import shard_dense
from moeflow.parallel.tensor_parallel import shard_of
from moeflow.topology import Topology
from tests.helpers import fsdp_cases as cases

TOL = dict(rtol=1e-9, atol=1e-12)


def test_dense_shard_values_are_validated():
    assert TrainConfig().dense_shard == "replicate"
    assert TrainConfig(dense_shard="fsdp", esp_size=2).dense_shard == "fsdp"
    assert TrainConfig(dense_shard="fsdp", mp_size=2).mp_size == 2      # FSDP2 over DP of MP
    with pytest.raises(ConfigError, match=r"^--dense-shard: TrainConfig.dense_shard='zero3' is "
                                          r"invalid: choose 'replicate' .* or 'fsdp'"):
        TrainConfig(dense_shard="zero3")


def test_cli_flag_reaches_the_config():
    from moeflow.commands import train_command as train_cmd

    parser = argparse.ArgumentParser()
    train_cmd.register(parser.add_subparsers())
    _, tcfg = train_cmd.configs_from_args(parser.parse_args(["train", "--dense-shard", "fsdp"]))
    assert tcfg.dense_shard == "fsdp"
    _, tcfg = train_cmd.configs_from_args(parser.parse_args(["train", "--dense-shard", "fsdp",
                                                             "--mp", "2"]))
    assert (tcfg.dense_shard, tcfg.mp_size) == ("fsdp", 2)


def test_one_process_has_nothing_to_shard():
    model, _, topo = cases.build(None, False)
    before = [p for p in model.parameters()]
    assert shard_dense(model, topo) is model
    assert [p for p in model.parameters()] == before


def _run(tmp_path_factory, layout: str) -> tuple:
    root = tmp_path_factory.mktemp(f"fsdp-{layout}")
    results = launch_local(cases.worker, cases.WORLD, str(root), layout, timeout_s=240)
    return root, results, cases.reference()


def _check(root, results: dict, ref: dict, layout: str) -> None:
    for rank in range(cases.WORLD):
        got = results[rank]
        # every step's global loss: A (FSDP2), B (loaded from A, replicated), C (loaded from B)
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-10), rank
        # the dense part is sharded, the experts are not
        assert "tok.weight" in got["sharded"] and "blocks.1.ffn.router.weight" in got["sharded"]
        assert not any(".experts." in n for n in got["sharded"]) and not got["expert_dtensors"]
        assert got["local_numel"]["blocks.0.ffn.up.weight"] == 24 * 16 // cases.WORLD
        specs = got["tp_specs"]          # MP shards (with MP): this rank's block of the weight
        mp = cases.LAYOUTS[layout][1].get("mp_size", 1)
        assert len(specs) == (6 if mp > 1 else 0), (rank, sorted(specs))
        for name, value in got["dense_after_A"].items():
            want = ref["after_A"][name]
            want = shard_of(want, specs[name]) if name in specs else want
            torch.testing.assert_close(value, want, **TOL,
                                       msg=lambda m: f"{name} on rank {rank} ({layout}): {m}")
    # the last checkpoint (written with FSDP2 on) loads into one process: every parameter and
    # AdamW moment equals the uninterrupted run's
    model, opt, _ = cases.build(None, False)
    assert checkpoint.load(f"{root}/{layout}-C", model, opt) == cases.TRAIN.steps
    theirs = dict(ref["model"].named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, theirs[name], **TOL, msg=lambda m: f"{name}: {m}")
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][k], ref["opt"].state[theirs[name]][k],
                                       **TOL, msg=lambda m: f"{k} of {name}: {m}")


@pytest.mark.multirank
def test_fsdp_ep2_matches_one_process_across_checkpoint_layouts(tmp_path_factory):
    root, results, ref = _run(tmp_path_factory, "ep2")
    _check(root, results, ref, "ep2")


@pytest.mark.slow          # FSDP2 itself: the ep2 case above; Parm MP's dense mesh: tests/unit/cuda/test_cuda_review2_fsdp.py
@pytest.mark.multirank
def test_fsdp_with_mp_matches_one_process_across_checkpoint_layouts(tmp_path_factory):
    """Parm's MP 2 with S1 (the router's MP ranks hold different partial gradients), FSDP2
    over each MP rank's DP pair; checkpoints FSDP2 + MP -> MP -> FSDP2 + MP -> one process."""
    root, results, ref = _run(tmp_path_factory, "mp2_s1")
    _check(root, results, ref, "mp2_s1")


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["ep4", "fssdp", "esp2", "ep2_recompute", "mp2",
                                    "mp2_esp2"])
def test_fsdp_matches_one_process_slow_layouts(tmp_path_factory, layout):
    root, results, ref = _run(tmp_path_factory, layout)
    _check(root, results, ref, layout)


def test_reference_clips_and_learns():
    ref = cases.reference()
    assert ref["losses"][-1] < ref["losses"][0]
    assert not torch.equal(ref["after_A"]["tok.weight"],
                           dict(ref["model"].named_parameters())["tok.weight"])
