"""``moeflow bench dense-shard``'s measurements on one process: the resident-set fields it
reads, and the held-state count split into experts and dense part."""

from __future__ import annotations

import torch

from benchmarks.training import dense_shard
from benchmarks.training.train_steps import status_bytes
from moeflow.config import ModelConfig, TrainConfig
from moeflow.models import GPT
from moeflow.trainer import make_optimizer

CFG = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=24,
                  moe_every=2, moe=dict(num_experts=4, d_expert=8, top_k=2))


def test_resident_set_fields():
    rss, peak = status_bytes("VmRSS"), status_bytes("VmHWM")
    assert 0 < rss <= peak


def test_state_bytes_counts_params_grads_and_moments_once():
    model = GPT(CFG)
    opt = make_optimizer(model, TrainConfig(steps=1))
    _, loss = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    loss.backward()
    opt.step()
    got = dense_shard.state_bytes(model, opt)
    expert = sum(p.numel() for m in model.moe_layers() for p in m.experts.parameters()) * 4
    dense = sum(p.numel() for p in model.parameters()) * 4 - expert
    assert (got["expert_params"], got["expert_grads"], got["expert_optimizer"]) == \
        (expert, expert, 2 * expert)
    assert (got["dense_params"], got["dense_grads"], got["dense_optimizer"]) == \
        (dense, dense, 2 * dense)


def test_modes_default_to_both_and_one_can_run_alone():
    import argparse

    import pytest

    p = argparse.ArgumentParser()
    dense_shard.add_arguments(p)
    assert p.parse_args([]).modes == ["replicate", "fsdp"]
    assert p.parse_args(["--modes", "fsdp"]).modes == ["fsdp"]
    with pytest.raises(SystemExit):
        p.parse_args(["--modes", "zero3"])
