"""Dispatch plans: capacity mode with its empty slots sent ("pad") or trimmed ("trim")."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.config import ConfigError
from moeflow.dispatch import make_plan, permute
from moeflow.launch import launch_local


def test_trimmed_plan_is_the_padded_buffer_without_its_empty_rows():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0], [1, 0], [0, 2]])   # expert 0: 6
    x = torch.randn(6, 5)
    pad = make_plan(experts, 4, capacity=4)
    trim = make_plan(experts, 4, capacity=4, trim=True)
    assert trim.host_counts.tolist() == [4, 3, 2, 1]       # min(n_e, C): expert 0 drops 2
    assert trim.send_rows == 10 and pad.send_rows == 16
    assert int(trim.dropped) == int(pad.dropped) == 2
    padded, trimmed = permute(x, pad), permute(x, trim)
    used = torch.cat([torch.arange(e * 4, e * 4 + n) for e, n in enumerate([4, 3, 2, 1])])
    assert torch.equal(trimmed, padded.index_select(0, used))


def _pair(padding_a: str, padding_b: str, topo=None, **kw):
    cfg = dict(d_model=16, d_expert=24, num_experts=4, top_k=2, seed=3, **kw)
    a = mf.MoELayer(mf.MoEConfig(capacity_padding=padding_a, **cfg), topo).double()
    b = mf.MoELayer(mf.MoEConfig(capacity_padding=padding_b, **cfg), topo).double()
    b.load_state_dict(a.state_dict())
    return a, b


def _grads(layer, x):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    (y.square().sum() + layer.aux_loss).backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("factor", [1.25, 0.5])
@pytest.mark.parametrize("schedule,r", [("sequential", 1), ("pipelined", 3)])
def test_trim_computes_the_padded_function_float64(factor, schedule, r):
    a, b = _pair("pad", "trim", capacity_factor=factor, schedule=schedule, pipeline_degree=r)
    x = torch.randn(30, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for u, v in zip(_grads(a, x), _grads(b, x)):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)
    assert a.stats["dropped_fraction"] == b.stats["dropped_fraction"]


def _two_rank_worker() -> list:
    topo = mf.Topology.from_env()
    a, b = _pair("pad", "trim", topo, capacity_factor=1.0)
    # rank-dependent token counts: the kept counts differ per rank and per expert
    x = torch.randn(10 + 7 * topo.rank, 16, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(topo.rank))
    return [float((u - v).abs().max()) for u, v in zip(_grads(a, x), _grads(b, x))]


@pytest.mark.multirank
def test_trim_matches_pad_on_two_ranks():
    for diffs in launch_local(_two_rank_worker, 2, timeout_s=120).values():
        assert max(diffs) < 1e-12, diffs


def test_capacity_padding_is_validated():
    with pytest.raises(ConfigError, match="capacity_padding"):
        mf.MoEConfig(d_model=8, d_expert=8, num_experts=4, capacity_padding="none")
    with pytest.raises(ConfigError, match="capacity_padding.*a placement that sends only kept rows"):
        mf.MoEConfig(d_model=8, d_expert=8, num_experts=4, capacity_padding="trim",
                     placement="fssdp")
