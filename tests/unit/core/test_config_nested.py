"""The model config's one spelling: ``ModelConfig(..., moe=MoEConfig(...))`` (or a dict of
MoEConfig fields), the model-owned MoE fields (d_model, seed, layer_id), ``replace``, the
refusal of the old flat spelling, and a saved ``config.json`` of the old form."""

import dataclasses
import json

import pytest
import torch

from moeflow import ConfigError, GPTConfig, ModelConfig, MoEConfig
from moeflow.config import MODEL_OWNED_MOE_FIELDS, config_differences, model_preset
from moeflow.models.gpt import GPT

TEMPLATE = MoEConfig(d_model=64, d_expert=96, num_experts=4, top_k=1, capacity_factor=2.0,
                     capacity_padding="pad", gate_noise=0.0, renormalize=True, seed=3)
AS_DICT = dict(num_experts=4, d_expert=96, top_k=1, capacity_factor=2.0,
               capacity_padding="pad", renormalize=True)
SIZES = dict(vocab_size=64, seq_len=16, d_model=64, n_layers=2, n_heads=4, d_ff=128)


def test_template_and_dict_build_the_same_config():
    nested = GPTConfig(**SIZES, seed=3, moe=TEMPLATE)
    as_dict = ModelConfig(**SIZES, seed=3, moe=AS_DICT)
    assert nested == as_dict and isinstance(as_dict.moe, MoEConfig)
    for block in nested.moe_layer_ids():
        assert nested.moe_config(block) == TEMPLATE.replace(layer_id=block)
    # what checkpoints and config.json keep (asdict, moe nested) round-trips
    assert ModelConfig(**dataclasses.asdict(nested)) == nested
    assert ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(nested))),
                                 "test") == nested


def test_template_and_dict_compute_the_same():
    x = torch.randint(0, 64, (2, 16))
    a = GPT(GPTConfig(**SIZES, seed=3, moe=TEMPLATE))
    b = GPT(ModelConfig(**SIZES, seed=3, moe=AS_DICT))
    assert torch.equal(a(x)[0], b(x)[0])


def test_model_owns_width_seed_and_layer_id():
    assert MODEL_OWNED_MOE_FIELDS == ("d_model", "seed", "layer_id")
    cfg = ModelConfig(**SIZES, seed=7, moe={"num_experts": 4})
    assert (cfg.moe.d_model, cfg.moe.seed, cfg.moe_config(1).layer_id) == (64, 7, 1)
    # a template left at seed 0 takes the model's seed
    assert GPTConfig(**SIZES, seed=7, moe=TEMPLATE.replace(seed=0)).moe.seed == 7
    with pytest.raises(ConfigError, match=r"moe\.d_model=32.*must equal ModelConfig\.d_model=64"):
        GPTConfig(**SIZES, moe=TEMPLATE.replace(d_model=32))
    with pytest.raises(ConfigError, match=r"moe\.seed=3.*contradicts ModelConfig\.seed=0"):
        GPTConfig(**SIZES, moe=TEMPLATE)
    with pytest.raises(ConfigError, match=r"moe\.layer_id=2.*the model sets it"):
        GPTConfig(**SIZES, seed=3, moe=TEMPLATE.replace(layer_id=2))


def test_router_options_of_the_template_are_kept():
    smile = MoEConfig(d_model=64, d_expert=96, num_experts=4, router="bilevel", top_k=1,
                      router_options={"nodes": 2})
    cfg = GPTConfig(**SIZES, moe=smile)
    assert cfg.moe.bilevel_nodes == 2 and cfg.moe_config(1) == smile.replace(layer_id=1)


@pytest.mark.parametrize("flat", ["top_k", "codec", "placement", "fssdp", "num_experts",
                                  "num_shared_experts"])
def test_the_old_flat_spelling_names_the_new_one(flat):
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{flat}=.*set it as moe\.{flat} "
                                          rf".*--set moe\.{flat}="):
        ModelConfig(**{flat: 1})
    with pytest.raises(ConfigError, match=rf"moe\.{flat}"):
        model_preset("tiny", **{flat: 1})
    with pytest.raises(ConfigError, match=rf"moe\.{flat}"):
        ModelConfig().replace(**{flat: 1})
    with pytest.raises(ConfigError, match=rf"moe\.{flat}"):
        dataclasses.replace(ModelConfig(), **{flat: 1})


def test_moe_of_wrong_type_or_unknown_field_is_refused():
    with pytest.raises(ConfigError, match="must be a MoEConfig"):
        GPTConfig(**SIZES, moe=["capacity_padding"])
    with pytest.raises(ConfigError, match=r"ModelConfig\.moe\.top_kk=1.*did you mean 'top_k'"):
        GPTConfig(**SIZES, moe={"top_kk": 1})


def test_replace_changes_model_and_moe_fields_together():
    cfg = model_preset("tiny", moe={"capacity_padding": "pad"})
    new = cfg.replace(d_model=64, seed=2, moe={"top_k": 1})
    assert (new.d_model, new.moe.d_model, new.moe.seed, new.moe.top_k) == (64, 64, 2, 1)
    assert new.moe.capacity_padding == "pad" and new.moe.num_experts == cfg.moe.num_experts
    assert cfg.replace(moe=TEMPLATE.replace(d_model=128, seed=0)).moe.d_expert == 96
    assert config_differences(cfg, new) == {"d_model": (128, 64), "seed": (0, 2),
                                            "moe.d_model": (128, 64), "moe.top_k": (2, 1),
                                            "moe.seed": (0, 2)}


def test_preset_moe_dict_lays_over_the_preset():
    cfg = model_preset("small", moe={"top_k": 1})
    assert (cfg.moe.num_experts, cfg.moe.d_expert, cfg.moe.top_k) == (16, 512, 1)
    assert model_preset("small", moe=TEMPLATE.replace(d_model=256, seed=0)).moe.num_experts == 4


def test_old_flat_saved_config_gets_a_clear_error():
    saved = {"d_model": 128, "num_experts": 8, "top_k": 2, "moe": None}
    with pytest.raises(ConfigError, match=r"run/config.json: the model config is in the old "
                                          r"flat form \(MoE fields num_experts, top_k beside "
                                          r"'moe'\); move them into its 'moe' entry"):
        ModelConfig.from_dict(saved, "run/config.json")
