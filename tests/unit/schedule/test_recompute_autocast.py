"""``MoEConfig.recompute="moe_act"`` under autocast: the experts recomputed in backward run in
the forward's autocast dtype (as ``torch.utils.checkpoint`` reruns do), so the gradients equal
those of the layer that kept its experts' graphs."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf

BASE = dict(d_model=16, d_expert=24, num_experts=4, top_k=2, capacity_factor=None)


def _grads(recompute: str, schedule: str, r: int, shared: int):
    torch.manual_seed(0)
    cfg = mf.MoEConfig(**BASE, recompute=recompute, schedule=schedule,
                       pipeline_degree=r, num_shared_experts=shared)
    layer = mf.MoELayer(cfg)
    x = torch.randn(32, BASE["d_model"], generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == x.dtype     # the experts ran in bf16; the gated sum in float32
    y.float().square().sum().backward()
    return [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("schedule,r,shared", [("sequential", 1, 0), ("optsche", 2, 1)])
def test_moe_act_recomputes_in_the_forwards_autocast_dtype(schedule, r, shared):
    kept = _grads("none", schedule, r, shared)
    recomputed = _grads("moe_act", schedule, r, shared)
    for a, b in zip(kept, recomputed):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=0)
