"""HECATE Algorithm 1's overlap degree t = T_non-MoE * bw / expert_size (Section 4.2) needs a
measured T_non-MoE: without one (no early spAG, or a layer whose prefetch() is never called)
``materialize="sparse"`` is refused, never run as static placement with t = 0."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.options import FSSDPOptions


def _layer(**fssdp):
    return mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2,
                                    capacity_factor=None, placement="fssdp",
                                    fssdp=dict(materialize="sparse", bandwidth_Bps=1e9,
                                               **fssdp)))


def test_options_refuse_sparse_without_early_gather_or_t():
    with pytest.raises(ConfigError, match="early_gather=True or give overlap_degree"):
        FSSDPOptions(materialize="sparse", bandwidth_Bps=1e9, early_gather=False)
    FSSDPOptions(materialize="sparse", overlap_degree=2, early_gather=False)     # t given


def test_a_layer_without_prefetch_refuses_instead_of_running_static():
    layer, x = _layer(), torch.randn(6, 8)
    with pytest.raises(ConfigError, match="without a prefetch"):
        layer(x)
    layer = _layer()
    layer.prefetch()                         # what the GPT block does before its attention
    assert layer(x).shape == x.shape
    assert _layer(overlap_degree=1)(x).shape == x.shape       # t given: nothing to measure
