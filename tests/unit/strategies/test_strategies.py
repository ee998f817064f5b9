"""Expert placement strategies (moeflow/strategies/): the layer takes the strategy that
``MoEConfig.placement`` names from the registry, and a new strategy is one class and one
registration (docs/design.md, "How to add a strategy"): here a toy one for a world of one that
runs the experts on the padded send buffer directly, with no all-to-all."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.errors import ConfigError
from moeflow.strategies import (STRATEGIES, ExpertParallel, ExpertStrategy, FSSDP, NodeDedup,
                                Parm, register_strategy)
from moeflow.topology import Topology


@register_strategy("local")
class LocalExperts(ExpertStrategy):
    """World of one, capacity mode: every send row stays here; the experts see each expert's
    ``capacity`` rows (padding included, as the plan lays them out)."""

    trims_padding = False

    def exchange(self, send, runner, tokens, call):
        assert self.layer.topo.world_size == 1
        plan = call.plan
        return runner.experts(send, [plan.capacity] * plan.num_experts), None


def _layers(toy: str = "local", **kw):
    def cfg(placement):
        return mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, seed=3,
                            capacity_factor=1.0, placement=placement, **kw)
    return mf.MoELayer(cfg("ep")).double(), mf.MoELayer(cfg(toy)).double()


@pytest.mark.parametrize("padding", ["pad", "trim"])
def test_toy_strategy_matches_built_in(padding):
    built_in, toy = _layers(capacity_padding=padding)
    assert isinstance(built_in.strategy, ExpertParallel)
    assert type(toy.strategy) is LocalExperts
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = [m(xi) for m, xi in zip((built_in, toy), xs)]
    torch.testing.assert_close(ys[1], ys[0], rtol=1e-12, atol=1e-12)
    for y in ys:
        y.square().sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-12, atol=1e-12)
    for (n, p), (_, q) in zip(built_in.named_parameters(), toy.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=n)
    assert toy.stats["dropped_fraction"] == built_in.stats["dropped_fraction"]


@register_strategy("local_broken")
class Broken(LocalExperts):
    def exchange(self, send, runner, tokens, call):
        back, _ = super().exchange(send, runner, tokens, call)
        return back * 2, None


def test_toy_strategy_is_used():
    """The layer really routes through the registered strategy (a broken exchange shows)."""
    built_in, toy = _layers("local_broken", capacity_padding="pad")
    x = torch.randn(5, 8, dtype=torch.float64)
    assert not torch.allclose(toy(x), built_in(x))


def test_select_by_config():
    """The registry entry MoEConfig.placement names (world of one)."""
    def layer(placement, **kw):
        return mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2,
                                        placement=placement, **kw))
    ep, fssdp, parm = layer("ep"), layer("fssdp"), layer("parm")
    assert type(ep.strategy) is ExpertParallel and ep.strategy.trims_padding
    assert type(fssdp.strategy) is FSSDP and not fssdp.strategy.trims_padding
    assert type(parm.strategy) is Parm and not fssdp.strategy.trims(None)
    # Parm trims per schedule (strategies/parm/padding.py): whole experts here
    assert parm.strategy.trims(None) and parm.strategy.trims("ted")
    assert not parm.strategy.trims("s2")
    assert {"ep", "fssdp", "parm", "node_dedup"} <= set(STRATEGIES)
    assert STRATEGIES["node_dedup"] is NodeDedup and NodeDedup.combines_in_exchange


def test_bad_names_are_refused():
    with pytest.raises(ConfigError, match=r"placement='fsdp'.*did you mean 'fssdp'"):
        mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, placement="fsdp")
    with pytest.raises(ConfigError, match=r"a2a='node_dedup'.*placement='node_dedup'"):
        mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, a2a="node_dedup")
    with pytest.raises(ConfigError, match=r"FSSDP options need placement='fssdp'"):
        mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, fssdp={"window": 3})
    with pytest.raises(ConfigError, match=r"placement='node_dedup' is invalid on 1 node"):
        mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=16, num_experts=4,
                                 placement="node_dedup"))



def test_parm_layouts_run_parm():
    """'ep' on Parm's layouts (MP or ESP shards) is Parm's baseline: the one placement the
    topology still completes (moeflow.strategies.strategy_for)."""
    from moeflow.strategies import strategy_for

    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4)
    esp = Topology(rank=0, world_size=4, local_size=4, ep_size=2, esp_size=2)
    assert strategy_for(cfg, esp) is Parm
    assert strategy_for(cfg, Topology.single()) is ExpertParallel
    assert strategy_for(cfg.replace(placement="parm"), Topology.single()) is Parm
