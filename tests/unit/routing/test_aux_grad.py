"""moeflow/routing/aux_grad.py: a MoELayer's aux loss under activation checkpointing, float64.

Reentrant checkpointing runs the forward under no_grad, so ``layer.aux_loss`` added to the loss
trains no router (reproduced here); ``attach_aux_loss=True`` back-propagates it through the
output, and the router gradient then equals the one without checkpointing in both modes."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp

import moeflow as mf
from moeflow.routing.aux_grad import attach_aux_loss, missing_aux_grad


def _grads(checkpoint: bool | None, attach: bool, scale: float = 1.0):
    """(router grad, expert w1 grad, input grad, missing) of ``scale * (sum y^2 + aux)``;
    ``checkpoint``: None (no checkpointing) or use_reentrant."""
    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, capacity_factor=None,
                       aux_loss_coef=0.5, z_loss_coef=0.1)
    layer = mf.MoELayer(cfg, attach_aux_loss=attach).double().train()
    layer.aux_loss_backward_scale = scale
    x = torch.randn(10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    y = layer(x) if checkpoint is None else cp.checkpoint(layer, x, use_reentrant=checkpoint)
    loss = y.pow(2).sum()
    if not attach:
        loss = loss + layer.aux_loss
    missing = missing_aux_grad([layer])
    (scale * loss).backward()
    return layer.router.weight.grad, layer.experts.w1.grad, x.grad, missing


def test_reentrant_checkpointing_loses_the_aux_gradient_without_attach():
    ref = _grads(None, False)
    got = _grads(True, False)
    assert got[3] == [0]                        # detected: computed without autograd
    assert not torch.allclose(got[0], ref[0])   # the router lost the aux gradient ...
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=0)   # ... the rest is intact


@pytest.mark.parametrize("checkpoint,attach", [(True, True), (False, True), (False, False),
                                               (None, True)])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_router_gradient_equals_no_checkpointing(checkpoint, attach, scale):
    """Router, expert and input gradients equal the uncheckpointed layer's (aux added by
    hand): attached under reentrant / non-reentrant / no checkpointing, and collected under
    non-reentrant checkpointing; ``scale`` is the factor applied to the loss."""
    ref = _grads(None, False, scale)
    got = _grads(checkpoint, attach, scale)
    assert got[3] == []
    for a, b in zip(got[:3], ref[:3]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_attached_layer_keeps_a_detached_value():
    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, capacity_factor=None)
    layer = mf.MoELayer(cfg, attach_aux_loss=True).double()
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    layer(x)
    assert layer.aux_loss is not None and not layer.aux_loss.requires_grad
    assert layer.aux_loss > 0
    y = torch.ones(3)                           # nothing to attach to: unchanged
    assert attach_aux_loss(y, torch.zeros(())) is y
    with pytest.raises(mf.ConfigError, match="attach_aux_loss"):
        mf.MoELayer(cfg, attach_aux_loss="yes")
