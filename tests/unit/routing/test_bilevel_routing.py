"""SMILE bi-level routing: Eq. 3 gate weights, Eq. 4 additive loss, configuration errors."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.config import ConfigError
from moeflow.routing.bilevel_routing import additive_balance_loss

BASE = dict(d_model=8, d_expert=8, num_experts=8, top_k=1, router="bilevel", bilevel_nodes=2)


def test_weights_are_p_times_q_and_experts_are_node_major():
    layer = mf.MoELayer(mf.MoEConfig(**BASE, aux_loss_coef=0.0)).double()
    r = layer.router
    x = torch.randn(16, 8, dtype=torch.float64)
    out = r(x)
    p, q = torch.softmax(x @ r.node_weight, -1), torch.softmax(x @ r.local_weight, -1)
    i, j = p.argmax(-1), q.argmax(-1)
    assert torch.equal(out.experts[:, 0], i * 4 + j)
    torch.testing.assert_close(out.weights[:, 0], p.max(-1).values * q.max(-1).values)
    assert r.node_weight.shape == (8, 2) and r.local_weight.shape == (8, 4)   # O(n + m)


def test_top_k_per_level_enumerates_pairs():
    cfg = mf.MoEConfig(**{**BASE, "top_k": 4, "node_top_k": 2, "local_top_k": 2})
    out = mf.MoELayer(cfg).router(torch.randn(5, 8))
    assert out.experts.shape == (5, 4)
    for row in out.experts.tolist():                 # 2 nodes x 2 local experts, all distinct
        assert len(set(row)) == 4 and len({e // 4 for e in row}) == 2


def test_additive_loss_eq_4():
    n, m, T = 2, 4, 8
    p, q = torch.full((T, n), 1 / n), torch.full((T, m), 1 / m)
    nodes = torch.arange(T).remainder(n).unsqueeze(1)
    locals_ = torch.arange(T).remainder(m).unsqueeze(1)
    assert additive_balance_loss(p, nodes, q, locals_, 0.3, 0.7).item() == pytest.approx(1.0)
    # everything on node 0 and local expert 0, with hand-made probabilities
    p = torch.tensor([[0.9, 0.1]] * T)
    q = torch.tensor([[0.4, 0.2, 0.2, 0.2]] * T)
    zeros = torch.zeros(T, 1, dtype=torch.long)
    expect = 0.5 * n * 0.9 + 0.25 * m * 0.4
    assert additive_balance_loss(p, zeros, q, zeros, 0.5, 0.25).item() == pytest.approx(expect)


def test_unscaled_loss_is_about_twice_switch_at_init():
    x = torch.randn(512, 8)
    smile = mf.MoELayer(mf.MoEConfig(**BASE))
    switch = mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=8, num_experts=8, top_k=1))
    smile(x), switch(x)
    assert smile.stats["balance_loss"] == pytest.approx(2 * switch.stats["balance_loss"],
                                                        rel=0.15)


@pytest.mark.parametrize("change,message", [
    (dict(bilevel_nodes=None), "bilevel_nodes=None"),
    (dict(bilevel_nodes=3), "num_experts=8 .* multiple of bilevel_nodes=3"),
    (dict(node_top_k=3), "node_top_k=3"),
    (dict(local_top_k=5), "local_top_k=5"),
    (dict(top_k=2), "top_k=2 .* set top_k=1"),
    (dict(local_loss_coef=-1.0), "local_loss_coef=-1.0"),
])
def test_bad_bilevel_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        mf.MoEConfig(**{**BASE, **change})


def test_topology_must_match_the_node_groups():
    one_node = mf.Topology(rank=0, world_size=4, local_size=4, ep_size=4)
    with pytest.raises(ConfigError, match="bilevel_nodes=2 does not match .* 1 node"):
        mf.MoELayer(mf.MoEConfig(**BASE), one_node)
    # one node is supported with bilevel_nodes=1 (the node level is then trivial)
    layer = mf.MoELayer(mf.MoEConfig(**{**BASE, "bilevel_nodes": 1}), one_node)
    assert layer.router.node_weight.shape == (8, 1)
    with pytest.raises(ConfigError, match="ep_size=2"):
        mf.MoELayer(mf.MoEConfig(**BASE), mf.Topology(rank=0, world_size=4, local_size=2,
                                                      ep_size=2))


@pytest.mark.parametrize("choices", ["all_choices", "first_choice"])
def test_additive_loss_per_level_choices(choices):
    """With top-2 per level, ``first_choice`` is Eq. (4) as written (f from argmax p, argmax q);
    ``all_choices`` counts both choices of each level."""
    cfg = mf.MoEConfig(**{**BASE, "top_k": 4, "node_top_k": 2, "local_top_k": 2,
                          "balance_loss": choices, "aux_loss_coef": 0.5,
                          "local_loss_coef": 0.25})
    r = mf.MoELayer(cfg).router.double()
    x = torch.randn(12, 8, dtype=torch.float64)
    out = r(x)
    p, q = torch.softmax(x @ r.node_weight, -1), torch.softmax(x @ r.local_weight, -1)
    if choices == "first_choice":
        f_node = torch.nn.functional.one_hot(p.argmax(-1), 2).double().mean(0)
        f_local = torch.nn.functional.one_hot(q.argmax(-1), 4).double().mean(0)
    else:                                       # 2 of 2 nodes, 2 of 4 local experts each
        f_node = torch.full((2,), 0.5, dtype=torch.float64)
        f_local = torch.zeros(12, 4, dtype=torch.float64).scatter(
            1, q.topk(2, -1).indices, 1.0).mean(0) / 2
    expect = 2 * (f_node * p.mean(0)).sum(), 4 * (f_local * q.mean(0)).sum()
    torch.testing.assert_close(out.balance_loss, expect[0] + expect[1])
    torch.testing.assert_close(out.aux_loss, 0.5 * expect[0] + 0.25 * expect[1])


def test_smile_settings_in_router_options_equal_the_fields():
    """One form for every router's settings: SMILE's go in router_options too."""
    import moeflow as mf
    from moeflow.config import ConfigError

    base = dict(d_model=8, d_expert=16, num_experts=8, top_k=2, router="bilevel")
    new = mf.MoEConfig(**base, router_options={"nodes": 2, "node_top_k": 2,
                                               "local_loss_coef": 0.5})
    old = mf.MoEConfig(**base, bilevel_nodes=2, node_top_k=2, local_loss_coef=0.5)
    assert new == old and (new.bilevel_nodes, new.node_top_k) == (2, 2)
    assert new.replace(local_top_k=2, top_k=4).local_top_k == 2
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(mf.MoELayer(new)(x), mf.MoELayer(old)(x))
    with pytest.raises(ConfigError, match="did you mean 'node_top_k'"):
        mf.MoEConfig(**base, router_options={"nodes": 2, "node_topk": 2})
    with pytest.raises(ConfigError, match="contradicts bilevel_nodes=4"):
        mf.MoEConfig(**base, bilevel_nodes=4, router_options={"nodes": 2})
