"""Every bad configuration fails at construction with a message naming field, value and fix."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.config import ConfigError, ModelConfig, TrainConfig, model_preset

BASE = dict(d_model=8, d_expert=16, num_experts=4, top_k=2)


@pytest.mark.parametrize("change,field,hint", [
    (dict(top_k=5), "top_k=5", "num_experts"),
    (dict(top_k=0), "top_k=0", "positive"),
    (dict(num_experts=0), "num_experts=0", "positive"),
    (dict(d_model=-1), "d_model=-1", "positive"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0", "None for dropless"),
    (dict(capacity_factor=-1.5), "capacity_factor=-1.5", "> 0"),
    (dict(router="nope"), "router='nope'", "registered: bilevel, deepseek_v3, topk"),
    (dict(codec="zip"), "codec='zip'", "register_codec"),
    (dict(a2a="magic"), "a2a='magic'", "registered: bilevel, "),
    (dict(activation="tanhh"), "activation='tanhh'", "did you mean 'tanh'"),
    (dict(activation="softmax"), "activation='softmax'", "not an elementwise function"),
    (dict(activation="dropout"), "activation='dropout'", "not an elementwise function"),
    (dict(expert_bias="yes"), "expert_bias='yes'", "has_fc1_bias"),
    (dict(gate_noise=-0.1), "gate_noise=-0.1", ">= 0"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef=-1.0", ">= 0"),
    (dict(balance_loss="top1"), "balance_loss='top1'", "'first_choice' (f_e counts each"),
])
def test_moe_config_errors(change, field, hint):
    with pytest.raises(ConfigError) as err:
        mf.MoEConfig(**{**BASE, **change})
    assert f"MoEConfig.{field}" in str(err.value) and hint in str(err.value)


def test_experts_not_divisible_by_ep_size():
    topo = mf.Topology(rank=0, world_size=3, local_size=3, ep_size=3)
    with pytest.raises(ConfigError, match=r"num_experts=4 .* multiple of it; use 6 experts"):
        mf.MoELayer(mf.MoEConfig(**BASE), topo)


def test_d_model_mismatch_on_input():
    layer = mf.MoELayer(mf.MoEConfig(**BASE))
    with pytest.raises(ValueError, match=r"last dimension 9 but MoEConfig.d_model=8"):
        layer(torch.randn(3, 9))


@pytest.mark.parametrize("change,field", [
    (dict(n_heads=3), "n_heads=3"), (dict(moe_every=0), "moe_every=0"),
    (dict(dropout=1.0), "dropout=1.0"), (dict(moe=dict(top_k=9)), "MoEConfig.top_k=9"),
    (dict(seed=-1), "ModelConfig.seed=-1"),
])
def test_model_config_errors(change, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        ModelConfig(**change)


@pytest.mark.parametrize("change,field", [
    (dict(steps=0), "steps=0"), (dict(lr=0.0), "lr=0.0"),
    (dict(warmup_steps=2000), "warmup_steps=2000"), (dict(grad_clip=-1.0), "grad_clip=-1.0"),
    (dict(ep_size=0), "ep_size=0"), (dict(collective_timeout_s=0), "collective_timeout_s=0"),
])
def test_train_config_errors(change, field):
    with pytest.raises(ConfigError, match=f"TrainConfig.{field}"):
        TrainConfig(**change)


def test_presets_and_unknown_override():
    assert model_preset("tiny").num_moe_layers == 2
    with pytest.raises(ConfigError, match="preset='huge'"):
        model_preset("huge")
    with pytest.raises(ConfigError, match="ModelConfig.colour"):
        model_preset("tiny", colour=1)


def test_topology_without_distributed():
    topo = mf.Topology.from_env()
    assert (topo.world_size, topo.num_nodes, topo.ep_size) == (1, 1, 1)
    with pytest.raises(ConfigError, match="init_process_group"):
        mf.Topology.from_env(ep_size=2)


@pytest.mark.parametrize("make,suggestion", [
    (lambda: mf.MoEConfig(**BASE, router="topkk"), "did you mean 'topk'?"),
    (lambda: mf.MoEConfig(**BASE, codec="fp61"), "did you mean 'fp16'?"),
    (lambda: mf.MoEConfig(**BASE, a2a="direc"), "did you mean 'direct'?"),
    (lambda: mf.MoEConfig(**BASE, schedule="sequental"), "did you mean 'sequential'?"),
    (lambda: mf.MoEConfig(**BASE, activation="gelus"), "did you mean 'gelu'"),
    (lambda: mf.MoEConfig(**BASE, structure="bigmack"), "did you mean 'bigmac'?"),
    (lambda: model_preset("tiny", topk=1), "did you mean 'moe.top_k'?"),
    (lambda: model_preset("tiny", moe={"topk": 1}), "did you mean 'top_k'?"),
    (lambda: model_preset("tiny", n_layer=1), "did you mean 'n_layers'?"),
    (lambda: model_preset("tinyy"), "did you mean 'tiny'?"),
])
def test_typos_get_suggestions(make, suggestion):
    with pytest.raises(ConfigError) as err:
        make()
    assert suggestion in str(err.value)


def test_no_suggestion_for_a_name_far_from_every_choice():
    with pytest.raises(ConfigError) as err:
        mf.MoEConfig(**BASE, router="zzzzzz")
    assert "did you mean" not in str(err.value)


def test_registry_build_suggests_close_names():
    from moeflow.routing import ROUTERS

    with pytest.raises(KeyError, match="did you mean 'topk'"):
        ROUTERS.build("top-k")


def test_warmup_default_is_relative_to_steps():
    assert TrainConfig().warmup_steps == 30                 # min(30, steps // 10)
    assert TrainConfig(steps=100).warmup_steps == 10
    assert TrainConfig(steps=5).warmup_steps == 0           # `moeflow train --steps 5` works
    assert TrainConfig(steps=5, warmup_steps=5).warmup_steps == 5


@pytest.mark.parametrize("change,flag", [
    (dict(steps=10, warmup_steps=50), "--warmup-steps: TrainConfig.warmup_steps=50"),
    (dict(batch_size=0), "--batch-size: TrainConfig.batch_size=0"),
    (dict(collective_timeout_s=0), "--timeout: TrainConfig.collective_timeout_s=0"),
])
def test_train_config_errors_name_the_flag(change, flag):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**change)
    assert str(err.value).startswith(flag)


def test_from_hf_names_its_new_place():
    from moeflow.config import MoEConfig

    with pytest.raises(ConfigError, match="moeflow.integrations.hf.moe_config_from_hf"):
        MoEConfig.from_hf(object())
