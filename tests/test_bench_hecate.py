"""The HECATE benchmarks' inputs: the router skew really skews, random holders keep owners."""

from __future__ import annotations

import numpy as np
import torch

from moeflow import MoEConfig, MoELayer, Topology
from moeflow.bench.hecate import format_result, skew, variants
from moeflow.bench.spag import random_holders
from moeflow.placement import Placement


def _loads(s: float) -> np.ndarray:
    layer = MoELayer(MoEConfig(d_model=32, d_expert=16, num_experts=8, top_k=2,
                               capacity_factor=None, seed=1), Topology.single())
    skew(layer, s)
    x = torch.randn(2048, 32, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 1.0
    with torch.no_grad():
        chosen = layer.router(x).experts
    return np.bincount(chosen.reshape(-1).numpy(), minlength=8)


def test_skew_grows_with_s():
    ratios = [(c.max() / c.mean()) for c in map(_loads, (0.0, 1.0, 1.5))]
    assert ratios[0] < 1.5 < ratios[1] <= ratios[2]


def test_variants_and_table():
    names = [n for n, _ in variants(2, 1)]
    assert names == ["ep", "fssdp static", "fssdp alg1", "fssdp alg1 rm"]
    row = {"zipf_s": 1.0, "variant": "ep", "step_ms": 10.0, "speedup_vs_ep": 1.0,
           "max_tokens_per_rank": 5, "max_over_mean": 1.25}
    assert "ep" in format_result({"topology": "T", "rows": [row]})


def test_random_holders_keep_owners_and_bound_replicas():
    owners = Placement.even(8, 4)
    holders = random_holders(8, 4, owners, 2, seed=3)
    assert all(owners.owners[e] in h and len(h) <= 3 for e, h in enumerate(holders))
    assert any(len(h) > 1 for h in holders)
