"""FSSDP's slot storage and optimizers (moeflow/strategies/fssdp/optimizers.py): elementwise optimizers
step it as they would separate experts; the others are refused at their first step, with the
fix named; a custom optimizer can be declared elementwise."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer
from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.optimizers import ELEMENTWISE_OPTIMIZERS, elementwise_optimizer
from tests.helpers import parity


def _layers():
    cfg = parity.make_config("dropless_k2", placement="fssdp")
    fssdp, ep = MoELayer(cfg), MoELayer(cfg.replace(placement="ep", fssdp=None))
    return fssdp, ep


def _step(layer, opt_cls, **kw):
    opt = opt_cls(layer.parameters(), **kw)
    x = torch.randn(6, layer.cfg.d_model, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    layer.to(torch.float64)
    layer(x).square().sum().backward()
    opt.step()
    return opt


@pytest.mark.parametrize("opt_cls", sorted(ELEMENTWISE_OPTIMIZERS - {torch.optim.SGD},
                                           key=lambda c: c.__name__) + [torch.optim.SGD])
def test_elementwise_optimizers_step_fssdp_like_separate_experts(opt_cls):
    fssdp, ep = _layers()
    _step(fssdp, opt_cls, lr=0.01)
    _step(ep, opt_cls, lr=0.01)
    owned = fssdp.experts.owned_experts()
    for e, params in owned.items():
        for name, value in params.items():
            torch.testing.assert_close(value, getattr(ep.experts, name)[e], rtol=1e-9, atol=1e-12)


class LambLike(torch.optim.Optimizer):
    """A trust-ratio optimizer (LAMB / LARS): the step of a tensor scales with its norm."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"] * float(p.norm() / (p.grad.norm() + 1e-12)))


@pytest.mark.parametrize("opt_cls", [torch.optim.Adafactor, torch.optim.LBFGS, LambLike])
def test_optimizers_that_reduce_over_a_tensor_are_refused(opt_cls):
    fssdp, _ = _layers()
    with pytest.raises(ConfigError, match="cannot step FSSDP experts") as err:
        _step(fssdp, opt_cls, lr=0.01)
    assert "elementwise_optimizer" in str(err.value) and "placement='ep'" in str(err.value)
    _, ep = _layers()
    if opt_cls is not torch.optim.LBFGS:           # L-BFGS's step needs a closure
        _step(ep, opt_cls, lr=0.01)                # no slot tensor: nothing refused


def test_a_declared_optimizer_is_accepted_and_a_new_param_group_is_checked_again():
    class Declared(LambLike):
        pass

    fssdp, ep = _layers()
    with pytest.raises(ConfigError):
        _step(fssdp, Declared)
    elementwise_optimizer(Declared)
    try:
        _step(fssdp, Declared)
    finally:
        ELEMENTWISE_OPTIMIZERS.discard(Declared)
    opt = _step(ep, LambLike)                       # checked once, no slot tensor
    opt.add_param_group({"params": [fssdp.experts.slots]})
    with pytest.raises(ConfigError, match="LambLike cannot step FSSDP experts"):
        opt.step()
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        elementwise_optimizer(int)
