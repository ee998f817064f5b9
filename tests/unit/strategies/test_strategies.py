"""Expert placement strategies (moeflow/strategies/): the layer picks EP / Parm / FSSDP from
its config, and a new strategy is a subclass plugged into the layer (docs/design.md,
"Strategies: how experts are placed"): here a toy one for a world of one that runs the
experts on the padded send buffer directly, with no all-to-all."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.strategies import ExpertParallel, ExpertStrategy, FSSDP, Parm


class LocalExperts(ExpertStrategy):
    """World of one, capacity mode: every send row stays here; the experts see each expert's
    ``capacity`` rows (padding included, as the plan lays them out)."""

    name = "local"
    trims_padding = False

    def exchange(self, send, plan, runner, tokens, call):
        assert self.layer.topo.world_size == 1
        return runner.experts(send, [plan.capacity] * plan.num_experts), None


def _layers(**kw):
    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, seed=3,
                       capacity_factor=1.0, **kw)
    built_in, toy = mf.MoELayer(cfg).double(), mf.MoELayer(cfg).double()
    toy.strategy = LocalExperts(toy)
    return built_in, toy


@pytest.mark.parametrize("padding", ["pad", "trim"])
def test_toy_strategy_matches_built_in(padding):
    built_in, toy = _layers(capacity_padding=padding)
    assert isinstance(built_in.strategy, ExpertParallel)
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


def test_toy_strategy_is_used():
    """The layer really routes through the assigned strategy (a broken exchange shows)."""
    class Broken(LocalExperts):
        def exchange(self, send, plan, runner, tokens, call):
            back, _ = super().exchange(send, plan, runner, tokens, call)
            return back * 2, None
    built_in, toy = _layers(capacity_padding="pad")
    toy.strategy = Broken(toy)
    x = torch.randn(5, 8, dtype=torch.float64)
    assert not torch.allclose(toy(x), built_in(x))


def test_select_by_config():
    """FSSDP for placement='fssdp', Parm for ESP shards, plain EP otherwise (world of one)."""
    ep = mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2))
    fssdp = mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2,
                                     placement="fssdp"))
    assert type(ep.strategy) is ExpertParallel and ep.strategy.trims_padding
    assert type(fssdp.strategy) is FSSDP and not fssdp.strategy.trims_padding
    assert not Parm.trims_padding
