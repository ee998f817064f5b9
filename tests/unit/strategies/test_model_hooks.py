"""The model-level strategy calls (moeflow/strategies/model_hooks.py) on a GPT of one process:
the strategies are found through the model's MoE layers, and each strategy class is called
once with its layers (FSSDP: one slot tensor for all layers, HECATE Algorithm 2; its
checkpoint entries under expert parallelism's keys; its training metrics)."""

from __future__ import annotations

import pytest
import torch

from moeflow.config import ConfigError, ModelConfig
from moeflow.models.gpt import GPT
from moeflow.strategies import FSSDP, ExpertParallel, model_hooks


def _gpt(placement: str, **kw) -> GPT:
    return GPT(ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2,
                           d_ff=32, moe_every=1, moe=dict(num_experts=2, d_expert=12, top_k=1,
                                                          placement=placement, **kw)))


def test_layers_by_strategy_and_shared_slots():
    fssdp = _gpt("fssdp")
    found = model_hooks.strategy_layers(fssdp)
    assert list(found) == [FSSDP] and len(found[FSSDP]) == 2
    slots = {id(m.experts.slots) for m in found[FSSDP]}
    assert len(slots) == 1                          # setup_model shared them (Algorithm 2)
    assert list(model_hooks.strategy_layers(_gpt("ep"))) == [ExpertParallel]


def test_checkpoint_entries_and_metrics():
    model = _gpt("fssdp")
    (entries,) = model_hooks.checkpoint_entries(model, None, None)
    assert entries.params == {id(model.blocks[0].ffn.experts.slots)}
    assert "model/blocks.1.ffn.experts.w1/expert/1" in entries.keys
    assert {"fssdp/blocks.0.ffn.experts/owners", "fssdp/blocks.1.ffn.experts/window"} \
        <= set(entries.meta)
    assert model_hooks.metrics(model) == {}         # no forward yet
    idx = torch.zeros((1, 8), dtype=torch.long)
    model(idx, idx)
    (tokens,) = model_hooks.metrics(model)["fssdp_rank_tokens"]   # one rank
    assert 0 < tokens <= 2 * 8                      # 2 layers x 8 tokens, less any dropped
    assert model_hooks.checkpoint_entries(_gpt("ep"), None, None) == []


def test_block_recompute_refused_by_the_strategy():
    model = _gpt("fssdp", fssdp={"rematerialize": True, "overlap_regather": True})
    model.checkpoint_blocks = True
    idx = torch.zeros((1, 8), dtype=torch.long)
    with pytest.raises(ConfigError, match=r"overlap_regather=True \(MoE layer 0\) is invalid "
                                          r"with activation recomputation"):
        model(idx, idx)
