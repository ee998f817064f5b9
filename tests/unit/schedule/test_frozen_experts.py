"""The scheduled backward (``moeflow/schedule/pipeline.py``, ScheMoE section 4) with frozen
experts or frozen shared experts (``requires_grad_(False)``, e.g. fine-tuning the router only):
the input and the trainable parameters get the gradients of the unfrozen layer, the frozen ones
none, as autograd gives a frozen parameter."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf

BASE = dict(d_model=16, d_expert=24, num_experts=4, top_k=2, capacity_factor=None)


def _run(freeze: str, schedule: str, r: int, recompute: str):
    torch.manual_seed(0)
    cfg = mf.MoEConfig(**BASE, schedule=schedule,
                       pipeline_degree=r, num_shared_experts=1, recompute=recompute)
    layer = mf.MoELayer(cfg).double()
    frozen = {n for n, _ in layer.named_parameters() if freeze and n.startswith(freeze)}
    for n, p in layer.named_parameters():
        p.requires_grad_(n not in frozen)
    x = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    layer(x).square().sum().backward()
    return x.grad, {n: p.grad for n, p in layer.named_parameters()}, frozen


@pytest.mark.parametrize("freeze", ["experts.", "shared"])
@pytest.mark.parametrize("schedule,r,recompute", [("optsche", 2, "none"),
                                                  ("sequential", 1, "moe_act")])
def test_frozen_parts_get_no_gradient_and_the_rest_are_unchanged(freeze, schedule, r,
                                                                recompute):
    gx, grads, _ = _run("", schedule, r, recompute)
    fx, fgrads, frozen = _run(freeze, schedule, r, recompute)
    assert frozen, f"no parameter named {freeze}*"
    torch.testing.assert_close(fx, gx, rtol=0, atol=0)
    for n, g in fgrads.items():
        if n in frozen:
            assert g is None, n
        else:
            torch.testing.assert_close(g, grads[n], rtol=0, atol=0)
