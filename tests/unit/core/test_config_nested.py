"""The nested model config, ``GPTConfig(..., moe=MoEConfig(...))``, against the flat one."""

import dataclasses

import pytest
import torch

from moeflow import ConfigError, GPTConfig, ModelConfig, MoEConfig
from moeflow.models.gpt import GPT

TEMPLATE = MoEConfig(d_model=64, d_expert=96, num_experts=4, top_k=1, capacity_factor=2.0,
                     capacity_padding="pad", gate_noise=0.0, renormalize=True, seed=3)
FLAT = dict(num_experts=4, d_expert=96, top_k=1, capacity_factor=2.0, seed=3,
            moe={"capacity_padding": "pad", "renormalize": True})
SIZES = dict(vocab_size=64, seq_len=16, d_model=64, n_layers=2, n_heads=4, d_ff=128)


def test_nested_equals_flat_config():
    nested = GPTConfig(**SIZES, moe=TEMPLATE)
    flat = ModelConfig(**SIZES, **FLAT)
    assert nested == flat
    for block in nested.moe_layer_ids():
        assert nested.moe_config(block) == TEMPLATE.replace(layer_id=block)
    # stored flat: asdict (what checkpoints keep) round-trips
    assert ModelConfig(**dataclasses.asdict(nested)) == nested


def test_nested_model_computes_as_flat():
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 16))
    a, b = GPT(GPTConfig(**SIZES, moe=TEMPLATE)), GPT(ModelConfig(**SIZES, **FLAT))
    assert torch.equal(a(x)[0] if isinstance(a(x), tuple) else a(x),
                       b(x)[0] if isinstance(b(x), tuple) else b(x))


def test_nested_router_options_unpacked():
    smile = MoEConfig(d_model=64, d_expert=96, num_experts=4, router="bilevel", top_k=1,
                      router_options={"nodes": 2})
    cfg = GPTConfig(**SIZES, moe=smile)
    assert cfg.bilevel_nodes == 2 and cfg.moe_config(1) == smile.replace(layer_id=1)


def test_nested_width_must_match():
    with pytest.raises(ConfigError, match=r"moe\.d_model=32.*must equal ModelConfig\.d_model=64"):
        GPTConfig(**SIZES, moe=TEMPLATE.replace(d_model=32))


def test_flat_field_contradicting_nested_is_refused():
    with pytest.raises(ConfigError, match=r"ModelConfig\.top_k=3.*contradicts moe\.top_k=1"):
        GPTConfig(**SIZES, top_k=3, moe=TEMPLATE)


def test_moe_of_wrong_type_is_refused():
    with pytest.raises(ConfigError, match="must be a MoEConfig"):
        GPTConfig(**SIZES, moe=["capacity_padding"])


def test_flat_field_contradicting_a_nested_default_is_refused():
    with pytest.raises(ConfigError, match=r"ModelConfig\.codec='fp16'.*contradicts moe\.codec"):
        GPTConfig(**SIZES, codec="fp16", moe=TEMPLATE)
