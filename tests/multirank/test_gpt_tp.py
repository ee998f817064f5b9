"""Tensor parallelism of the GPT (Parm's MP): a full training step on 4 ranks equals one process
in float64, shards are slices of the global weights, bad sizes are refused, and the trainer
feeds the ranks of an MP group one batch."""

from __future__ import annotations

import pytest
import torch

from moeflow.config import ConfigError
from moeflow.launch import launch_local
from moeflow.models import GPT
from moeflow.parallel.tensor_parallel import shard_of, tp_shard
from moeflow.topology import Topology
from tests.helpers import gpt_tp_cases as cases

TOL = dict(rtol=1e-9, atol=1e-12)
# moeflow clips with a float32 norm (parallel/grad_clip.py), so the clipped gradients carry a
# relative error of ~1e-7, which AdamW turns into ~1e-10 on the parameters (steps of ~lr=1e-2)
PARAM_TOL = dict(rtol=1e-9, atol=1e-9)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch_local(cases.worker, cases.WORLD, list(cases.LAYOUTS),
                        str(tmp_path_factory.mktemp("trainer")), timeout_s=180)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(cases.LAYOUTS))
def test_training_steps_match_one_process(results, layout):
    mp = cases.LAYOUTS[layout][0]
    ref = cases.reference(mp, cases.config(layout))
    for rank in range(cases.WORLD):
        got = results[rank][layout]
        for step in range(cases.STEPS):
            assert got["loss"][step] == pytest.approx(ref["loss"][step][rank // mp], rel=1e-10)
            assert got["norm"][step] == pytest.approx(ref["norm"][step], rel=1e-6)  # float32
        for what in ("grads", "params"):
            for name, value in got[what].items():
                expect = cases.global_slice(ref[what][name], got["locate"][name], name)
                tol = TOL if what == "grads" else PARAM_TOL
                torch.testing.assert_close(value, expect, **tol, msg=lambda m: (
                    f"{what} of {name} on rank {rank} ({layout}): {m}"))
        kinds = {w[0] for w in got["locate"].values()}
        assert "tp" in kinds and "expert" in kinds
    assert ref["norm"][0] > cases.TRAIN.grad_clip          # clipping was active


@pytest.mark.multirank
def test_diverged_tensor_parallel_shard_is_named(results):
    for rank in range(cases.WORLD):
        msg = results[rank]["mp2_ep2"]["mismatch"]
        assert msg is not None and "tensor-parallel parameter 'blocks.0.attn.qkv.weight' of " \
                                    "MP rank 0" in msg, msg


@pytest.mark.multirank
def test_trainer_feeds_an_mp_group_one_batch(results):
    """moeflow train draws the batch of the data-parallel rank (rank // mp_size)."""
    got = [results[rank]["trainer"] for rank in range(cases.WORLD)]
    for rank in range(cases.WORLD):
        assert got[rank]["seen"][0][-1] == got[rank]["dp_rank"] == rank // 2
        assert got[rank]["seen"] == got[rank ^ 1]["seen"]
        assert got[rank]["loss"] == got[rank ^ 1]["loss"]
    batches = got[0]["batches"]
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[2], batches[3])
    assert not torch.equal(batches[0], batches[2])


def _fake_topo(rank: int, mp: int) -> Topology:
    return Topology(rank=rank, world_size=4, local_size=4, ep_size=4, mp_size=mp)


def test_shards_are_slices_of_the_global_weights():
    full = dict(GPT(cases.CFG).named_parameters())
    heads = cases.CFG.d_model // 2
    for rank in range(2):
        part = GPT(cases.CFG, _fake_topo(rank, 2))
        assert part.blocks[0].attn.n_heads == 2
        for name, p in part.named_parameters():
            spec = tp_shard(p)
            if ".experts." in name:
                continue
            if spec is None:
                assert torch.equal(p, full[name]), name
                continue
            assert torch.equal(p, shard_of(full[name], spec)), name
        q, k, v = full["blocks.0.attn.qkv.weight"].chunk(3)
        expect = torch.cat([t[rank * heads:(rank + 1) * heads] for t in (q, k, v)])
        assert torch.equal(part.blocks[0].attn.qkv.weight, expect)
        assert torch.equal(part.blocks[0].ffn.down.weight,
                           full["blocks.0.ffn.down.weight"][:, rank * 12:(rank + 1) * 12])


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(ConfigError, match=r"ModelConfig.n_heads=4 is invalid with mp_size=3"):
        GPT(cases.CFG, Topology(rank=0, world_size=3, local_size=3, ep_size=1, mp_size=3))
    cfg = cases.CFG.replace(d_ff=30)
    with pytest.raises(ConfigError, match=r"ModelConfig.d_ff=30 is invalid with mp_size=4"):
        GPT(cfg, _fake_topo(0, 4))
