"""The HECATE benchmarks' pieces: the router skew really skews (Zipf and a real router's loads),
random holders keep owners, the variants build, FasterMoE-style shadowing placements, and the
memory accounting (parameters, gradients, Adam state, materialized experts)."""

from __future__ import annotations

import numpy as np
import torch

from moeflow import MoEConfig, MoELayer, Topology
from benchmarks.hecate.hecate import format_result, skew, variants
from benchmarks.hecate.spag import random_holders
from moeflow.strategies.fssdp import Placement


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
    assert names == ["ep", "shadow", "replace", "fssdp static", "fssdp alg1", "fssdp alg1 rm",
                     "fssdp alg2", "hecate", "hecate rm"]
    assert [n for n, _ in variants(2, 1, [3])][-1] == "hecate reshard/3"
    for _, v in variants(2, 1, [3]):            # every variant builds a valid config
        MoEConfig(d_model=8, d_expert=8, num_experts=4,
                  **{k: x for k, x in v.items() if not k.startswith("_")})
    row = {"zipf_s": 1.0, "variant": "ep", "step_ms": 10.0, "speedup_vs_ep": 1.0,
           "max_tokens_per_rank": 5, "max_over_mean": 1.25}
    assert "ep" in format_result({"topology": "T", "rows": [row]})
    mem = {"params": [2**20], "grads": [2**20], "optimizer": [2**21],
           "materialized_held": [0], "materialized_rows": [0]}
    assert "1.0/1.0/2.0" in format_result({"topology": "T", "rows": [
        {**row, "a2a_ms": 3.0, "memory_bytes_per_rank": mem}]})


def test_bench_worker_runs_the_replace_variant_in_one_process():
    from benchmarks.hecate.hecate import bench_worker

    opts = dict(tokens=64, d_model=16, d_expert=16, experts_per_rank=4, top_k=2, zipf=[1.5],
                t=1, m=1, warmup=1, reps=2, replace_every=1, variants=["ep", "replace"])
    res = bench_worker(opts)
    rows = {r["variant"]: r for r in res["rows"]}
    assert list(rows) == ["ep", "replace"]
    # one process: every expert on rank 0 whatever the owners, the loads are the same
    assert rows["replace"]["tokens_per_rank"] == rows["ep"]["tokens_per_rank"] == [128]
    assert len(rows["replace"]["samples_ms"]) == 2 and rows["replace"]["owners"] == [0] * 4


def test_random_holders_keep_owners_and_bound_replicas():
    owners = Placement.even(8, 4)
    holders = random_holders(8, 4, owners, 2, seed=3)
    assert all(owners.owners[e] in h and len(h) <= 3 for e, h in enumerate(holders))
    assert any(len(h) > 1 for h in holders)


# -- the added systems and columns: shadowing, memory accounting ----------------------

def test_shadow_placement_replicates_top_experts_everywhere_owners_static():
    from benchmarks.hecate.shadow import shadow_placement

    owners = Placement.even(8, 4)
    loads = np.array([5, 90, 1, 90, 7, 3, 50, 2])
    p = shadow_placement(owners, loads, 2)
    assert p.owners == owners.owners                       # P static
    assert p.holders[1] == p.holders[3] == frozenset(range(4))   # ties: both 90s
    assert all(p.holders[e] == {owners.owners[e]} for e in range(8) if e not in (1, 3))
    p3 = shadow_placement(owners, loads, 3)
    assert p3.holders[6] == frozenset(range(4))
    assert shadow_placement(owners, loads, 0).is_static


def test_shadow_placement_rejects_bad_input():
    import pytest

    from benchmarks.hecate.shadow import shadow_placement
    from moeflow.errors import ConfigError

    owners = Placement.even(4, 2)
    with pytest.raises(ConfigError, match="num_shadowed"):
        shadow_placement(owners, np.ones(4), 5)
    with pytest.raises(ConfigError, match="one load per expert"):
        shadow_placement(owners, np.ones(3), 1)


def test_state_bytes_counts_params_grads_and_adam_state():
    from benchmarks.hecate.hecate_memory import state_bytes

    layer = MoELayer(MoEConfig(d_model=16, d_expert=8, num_experts=4, top_k=2,
                               capacity_factor=None, seed=1), Topology.single())
    n = sum(p.numel() * p.element_size() for p in layer.parameters())
    opt = torch.optim.Adam(layer.parameters())
    assert state_bytes(layer, opt) == {"params": n, "grads": 0, "optimizer": 0}
    layer(torch.randn(32, 16)).square().mean().backward()
    opt.step()
    got = state_bytes(layer, opt)
    n_params = len(list(layer.parameters()))
    assert got["params"] == n and got["grads"] == n
    # exp_avg + exp_avg_sq per parameter, plus Adam's scalar step (float32) per parameter
    assert got["optimizer"] == 2 * n + 4 * n_params


def test_materialized_probe_reads_the_held_experts_between_forward_and_backward():
    from benchmarks.hecate.hecate_memory import MaterializedProbe

    topo = Topology.single()
    cfg = MoEConfig(d_model=16, d_expert=8, num_experts=4, top_k=2, capacity_factor=None,
                    seed=1)
    fs = MoELayer(cfg.replace(placement="fssdp"), topo)
    probe = MaterializedProbe(fs.experts)
    x = torch.randn(32, 16)
    y = fs(x)
    ex = fs.experts
    assert probe.rows() == 4 and probe.held_bytes() == 4 * ex.expert_bytes
    y.square().mean().backward()            # the probe does not change the computation
    ref = MoELayer(cfg.replace(placement="fssdp"), topo)
    ref(x).square().mean().backward()
    assert torch.equal(ex.slots.grad, ref.experts.slots.grad)
    ep = MoELayer(cfg, topo)
    ep_probe = MaterializedProbe(ep.experts)
    ep(x)
    assert ep_probe.held_bytes() == 0


def test_router_loads_prior_follows_a_real_routers_loads(tmp_path):
    import json

    from benchmarks.hecate.hecate import read_router_loads

    real = [1602, 33, 893, 12951, 12254, 2772, 538, 1725]
    path = tmp_path / "loads.json"
    path.write_text(json.dumps([{"run": "r", "step": 3, "loads_after": [[1] * 8, real]}]))
    loads, source = read_router_loads(f"{path}:0:1")
    assert loads == real and "MoE layer 1" in source
    layer = MoELayer(MoEConfig(d_model=32, d_expert=16, num_experts=8, top_k=2,
                               capacity_factor=None, seed=1), Topology.single())
    skew(layer, 0.0, loads=real)
    x = torch.randn(2048, 32, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 1.0
    with torch.no_grad():
        got = np.bincount(layer.router(x).experts.reshape(-1).numpy(),
                          minlength=8)
    assert set(np.argsort(got)[-2:]) == {3, 4}         # the real router's two hot experts
    assert got[1] == got.min()
