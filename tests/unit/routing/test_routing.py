"""Router math against the formulas: gates, capacity, drop order, balancing and z losses."""

from __future__ import annotations

import math

import pytest
import torch

import moeflow as mf
from moeflow.dispatch import capacity
from moeflow.routing.losses import balance_loss, z_loss


def _router(**kw):
    cfg = mf.MoEConfig(d_model=4, d_expert=8, **{"num_experts": 4, "top_k": 2, **kw})
    return mf.MoELayer(cfg).router.double()


def test_topk_gates_follow_softmax():
    r = _router(top_k=2)
    x = torch.randn(5, 4, dtype=torch.float64)
    out = r(x)
    probs = torch.softmax(x @ r.weight, -1)
    top = probs.topk(2, -1)
    assert torch.equal(out.experts, top.indices)
    torch.testing.assert_close(out.weights, top.values / top.values.sum(-1, keepdim=True))
    r1 = _router(top_k=1)                                   # Switch: raw probability
    torch.testing.assert_close(r1(x).weights, torch.softmax(x @ r1.weight, -1).max(-1,
                               keepdim=True).values)


def test_router_math_is_at_least_float32():
    r = _router()
    out = r(torch.randn(3, 4, dtype=torch.bfloat16))
    assert out.weights.dtype == torch.float32


def test_gate_noise_only_in_training():
    r = _router(gate_noise=1.0)
    x = torch.randn(64, 4, dtype=torch.float64)
    r.eval()
    assert torch.equal(r(x).weights, r(x).weights)
    r.train()
    assert not torch.equal(r(x).weights, r(x).weights)


def test_balance_loss_formula_and_uniform_minimum():
    E, T = 4, 8
    probs = torch.full((T, E), 1.0 / E)
    experts = torch.arange(T).remainder(E).unsqueeze(1)            # perfectly balanced
    assert balance_loss(probs, experts, E).item() == pytest.approx(1.0)
    probs = torch.softmax(torch.randn(T, E), -1)
    experts = torch.zeros(T, 1, dtype=torch.long)                  # all to expert 0
    assert balance_loss(probs, experts, E).item() == pytest.approx(E * probs[:, 0].mean().item())
    experts = torch.tensor([[0, 1]] * T)                           # f counts all k choices
    expect = E * 0.5 * (probs[:, 0].mean() + probs[:, 1].mean())
    assert balance_loss(probs, experts, E).item() == pytest.approx(expect.item())


def test_z_loss_formula():
    logits = torch.randn(6, 4, dtype=torch.float64)
    expect = (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
    torch.testing.assert_close(z_loss(logits), expect)


def test_aux_loss_coefficients():
    r = _router(aux_loss_coef=0.3, z_loss_coef=0.05)
    out = r(torch.randn(7, 4, dtype=torch.float64))
    torch.testing.assert_close(out.aux_loss, 0.3 * out.balance_loss + 0.05 * out.z_loss)


@pytest.mark.parametrize("T,k,E,f", [(64, 2, 8, 1.25), (10, 1, 4, 1.0), (7, 2, 4, 0.5),
                                     (3, 4, 4, 1.0), (0, 2, 8, 1.25)])
def test_capacity_formula(T, k, E, f):
    assert capacity(T, k, E, f) == math.ceil(round(f * k * T / E, 9))
    assert capacity(64, 2, 8, 1.25) == 20


def test_drop_order_first_choices_before_second():
    """GShard priority: all first choices in token order, then second choices."""
    from moeflow.dispatch import make_plan

    # 4 tokens; expert 0 is the first choice of tokens 2,3 and second choice of tokens 0,1
    experts = torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]])
    plan = make_plan(experts, 2, capacity=3)
    T = 4                                     # choice a = j*T + t; slot E*C = 6 means dropped
    slots = {(a % T, a // T): s for a, s in enumerate(plan.slot.tolist())}
    kept = sorted(k for k, s in slots.items() if s < plan.send_rows)
    # expert 0 slots: (2,0), (3,0), then (0,1); (1,1) dropped. expert 1: (0,0),(1,0),(2,1)
    assert kept == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (3, 0)]
    assert int(plan.dropped) == 2 and plan.send_rows == 6
    assert [slots[(2, 0)], slots[(3, 0)], slots[(0, 1)]] == [0, 1, 2]
    assert [slots[(0, 0)], slots[(1, 0)], slots[(2, 1)]] == [3, 4, 5]


def test_dropless_keeps_everything_and_all_to_one_expert():
    layer = mf.MoELayer(mf.MoEConfig(d_model=4, d_expert=8, num_experts=4, top_k=1,
                                     capacity_factor=None)).double()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, 2] = 5.0
    x = torch.rand(9, 4, dtype=torch.float64) + 1.0
    y = layer(x)
    assert layer.stats["dropped_fraction"] == 0.0
    assert (layer.router(x).experts == 2).all()
    w = layer.router(x).weights
    e = layer.experts
    expect = torch.nn.functional.gelu(x @ e.w1[2]) @ e.w2[2] * w
    torch.testing.assert_close(y, expect)


def test_layer_stats_stay_tensors_until_read():
    layer = mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2,
                                     z_loss_coef=1e-3))
    layer(torch.randn(32, 8))
    t = layer.stat_tensors
    assert isinstance(t["balance_loss"], torch.Tensor) and not t["balance_loss"].requires_grad
    assert isinstance(t["z_loss"], torch.Tensor) and t["z_loss"].dim() == 0
    s = layer.stats
    assert s["balance_loss"] == float(t["balance_loss"]) > 0
    assert s["z_loss"] == float(t["z_loss"]) > 0 and 0 <= s["dropped_fraction"] < 1


def test_all_choices_balance_loss_is_megatron_cores():
    """Megatron-core's switch_load_balancing_loss_func: E / (k T^2) * sum_e sum_t p_{t,e} *
    tokens_per_expert_e, tokens counted over the top-k routing map (all choices)."""
    r = _router(num_experts=4, top_k=2)
    x = torch.randn(9, 4, dtype=torch.float64)
    out = r(x)
    probs = torch.softmax(x @ r.weight, -1)
    T, E, k = 9, 4, 2
    routing_map = torch.zeros(T, E, dtype=torch.float64).scatter(1, out.experts, 1.0)
    expect = E / (k * T * T) * torch.sum(probs.sum(0) * routing_map.sum(0))
    torch.testing.assert_close(out.balance_loss, expect)


def test_first_choice_balance_loss_is_gshard_deepspeed_tutel():
    """GShard / DeepSpeed-MoE top2gating: me = mean gates, ce = mean(mask1) (first choice
    only), l_aux = mean(me * ce) * E^2; Tutel's gshard_loss: sum(me * ce) * E."""
    r = _router(num_experts=4, top_k=2, balance_loss="first_choice")
    x = torch.randn(9, 4, dtype=torch.float64)
    out = r(x)
    probs = torch.softmax(x @ r.weight, -1)
    E = 4
    me = probs.mean(0)
    mask1 = torch.nn.functional.one_hot(probs.argmax(-1), E).to(torch.float64)
    ce = mask1.mean(0)
    torch.testing.assert_close(out.balance_loss, torch.mean(me * ce) * E * E)
    torch.testing.assert_close(out.balance_loss, torch.sum(me * ce) * E)
    torch.testing.assert_close(out.aux_loss, 0.01 * out.balance_loss)
    # for k = 1 both definitions are Switch's
    for choices in ("first_choice", "all_choices"):
        torch.testing.assert_close(
            _router(num_experts=4, top_k=1, balance_loss=choices)(x).balance_loss,
            torch.sum(me * ce) * E)


def test_balance_loss_choices_differ_for_top2():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.4, 0.35, 0.15, 0.1]], dtype=torch.float64)
    experts = torch.tensor([[0, 1], [0, 1]])
    P = probs.mean(0)
    torch.testing.assert_close(balance_loss(probs, experts, 4, "first_choice"), 4 * P[0])
    torch.testing.assert_close(balance_loss(probs, experts, 4, "all_choices"),
                               4 * 0.5 * (P[0] + P[1]))
    with pytest.raises(ValueError, match="choices='top1'"):
        balance_loss(probs, experts, 4, "top1")
