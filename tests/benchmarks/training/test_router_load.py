"""benchmarks.training.router_load: the per-layer expert loads it reads from a model."""

from __future__ import annotations

from benchmarks.training.router_load import layer_loads, max_over_mean
from moeflow.config import ModelConfig
from moeflow.data import Corpus
from moeflow.models.gpt import GPT


def test_loads_count_every_choice_of_every_layer():
    cfg = ModelConfig(seq_len=16, d_model=16, n_layers=2, n_heads=2, d_ff=32, moe_every=1,
                      moe=dict(num_experts=4, d_expert=16, top_k=2, router="deepseek_v3",
                               router_options={"n_group": 2, "topk_group": 1}))
    loads = layer_loads(GPT(cfg), Corpus.load(), batches=2, batch_size=3)
    assert len(loads) == 2 and all(len(v) == 4 for v in loads)
    assert all(sum(v) == 2 * 3 * 16 * 2 for v in loads)


def test_max_over_mean():
    assert max_over_mean([4, 4, 4, 4]) == 1.0
    assert max_over_mean([8, 0, 0, 0]) == 4.0
