"""Shared experts through ModelConfig: ``moeflow train --set moe.num_shared_experts=1``
builds a GPT whose MoE layers have them, and a 2-step training run in one process works."""

from __future__ import annotations

import math

import pytest
import torch

from moeflow.cli import build_parser
from moeflow.commands.train_command import configs_from_args
from moeflow.config import ConfigError, ModelConfig, TrainConfig
from moeflow.experts.shared import SharedExperts
from moeflow.models.gpt import GPT
from moeflow.topology import Topology
from moeflow.trainer import Trainer

MICRO = dict(seq_len=32, d_model=32, n_layers=2, n_heads=2, d_ff=64, moe_every=1)
MICRO_MOE = dict(num_experts=4, d_expert=32, top_k=2)


def test_train_set_reaches_the_moe_layers():
    args = build_parser().parse_args(
        ["train", "--set", "moe.num_shared_experts=2", "--set", "moe.shared_expert_hidden=24",
         "--set", "moe.shared_expert_gate=true"])
    mcfg, _ = configs_from_args(args)
    assert (mcfg.moe.num_shared_experts, mcfg.moe.shared_expert_hidden,
            mcfg.moe.shared_expert_gate) == (2, 24, True)
    moe = mcfg.moe_config(mcfg.moe_layer_ids()[0])
    assert moe.shared_hidden == 48 and moe.shared_expert_gate
    model = GPT(ModelConfig(**MICRO, moe=dict(**MICRO_MOE, num_shared_experts=1)))
    layers = model.moe_layers()
    assert len(layers) == 2 and all(isinstance(m.shared, SharedExperts) for m in layers)
    assert all(m.shared.w1.shape == (32, 32) for m in layers)      # default width d_expert
    assert all(m.shared is None for m in GPT(ModelConfig(**MICRO, moe=MICRO_MOE)).moe_layers())
    with pytest.raises(ConfigError, match="num_shared_experts"):
        ModelConfig(**MICRO, moe=dict(**MICRO_MOE, shared_expert_gate=True))  # without experts


def test_two_step_training_with_shared_experts(tmp_path):
    mcfg = ModelConfig(**MICRO, moe=dict(**MICRO_MOE, num_shared_experts=1,
                                                shared_expert_gate=True))
    cfg = TrainConfig(steps=2, batch_size=2, warmup_steps=1, eval_every=2, eval_batches=1,
                      log_every=1)
    trainer = Trainer(mcfg, cfg, tmp_path, Topology.single(), progress=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
              if ".shared." in n}
    assert before and any(n.endswith("shared.gate") for n in before)
    result = trainer.run()
    assert result["step"] == 2
    assert all(math.isfinite(r["loss"]) for r in result["history"] if "loss" in r)
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(after[n], p) for n, p in before.items())   # they train
