"""MoELayer options and input checks: input dtype, scheduler validation, activations by name,
expert biases, per-call top_k / capacity_factor (the float64 layout parity of these options is in
``tests/helpers/parity.py``, run by ``test_layer_parity.py``)."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.config import ConfigError
from moeflow.schedule import Scheduler, Task, register_scheduler

BASE = dict(d_model=8, d_expert=16, num_experts=4, top_k=2)


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool])
def test_integer_input_is_refused_with_its_dtype(dtype):
    layer = mf.MoELayer(mf.MoEConfig(**BASE))
    with pytest.raises(TypeError, match=rf"dtype {dtype}; it must be floating point"):
        layer(torch.zeros(3, 8, dtype=dtype))


@register_scheduler("test-forgets-d2")
class ForgetsD2(Scheduler):
    """A broken user scheduler: no D2 tasks (the returned rows would never be decoded)."""

    def order(self, r):
        return [Task(k, i) for i in range(r) for k in ("C1", "D1", "E", "C2")]


@register_scheduler("test-bad-at-r2")
class BadAtTwo(Scheduler):
    """Valid at r = 1, but runs chunk 2's E before its D1 at r >= 2."""

    def order(self, r):
        order = [Task(k, i) for i in range(r) for k in ("C1", "D1", "E", "C2", "D2")]
        if r > 1:
            order[6], order[7] = order[7], order[6]
        return order


def test_bad_user_scheduler_fails_at_construction():
    with pytest.raises(ConfigError, match=r"MoEConfig.schedule='test-forgets-d2' is invalid at "
                                          r"pipeline_degree=2: .*ForgetsD2.order\(2\).*"
                                          r"exactly once"):
        mf.MoELayer(mf.MoEConfig(**BASE, schedule="test-forgets-d2", pipeline_degree=2))


def test_scheduler_is_checked_at_the_configured_degree():
    mf.MoELayer(mf.MoEConfig(**BASE, schedule="test-bad-at-r2"))        # fine at r = 1
    with pytest.raises(ConfigError, match=r"pipeline_degree=2: .*runs E\^2 before D1\^2"):
        mf.MoELayer(mf.MoEConfig(**BASE, schedule="test-bad-at-r2", pipeline_degree=2))


def test_scheduler_is_rechecked_when_the_degree_changes():
    """The profiler replaces ``layer.cfg`` to try other degrees: forward re-validates."""
    layer = mf.MoELayer(mf.MoEConfig(**BASE, schedule="test-bad-at-r2"))
    x = torch.randn(6, 8)
    layer(x)
    layer.cfg = layer.cfg.replace(pipeline_degree=2)
    with pytest.raises(ConfigError, match="pipeline_degree=2"):
        layer(x)


def _expert_formula(ffn, x, counts, act):
    """Each local expert's rows through ``W2 act(W1 x + b1) + b2`` (SwiGLU: ``silu(W1 x + b1)
    * (W3 x + b3)``), written out per expert."""
    outs, start = [], 0
    for i, n in enumerate(counts):
        xi = x[start:start + n]
        start += n
        h = xi @ ffn.w1[i] + (ffn.b1[i] if ffn.has_bias else 0)
        if act == "swiglu":
            h = torch.nn.functional.silu(h) * (xi @ ffn.w3[i] + (ffn.b3[i] if ffn.has_bias
                                                                 else 0))
        else:
            h = getattr(torch.nn.functional, act)(h)
        outs.append(h @ ffn.w2[i] + (ffn.b2[i] if ffn.has_bias else 0))
    return torch.cat(outs)


@pytest.mark.parametrize("act", ["gelu", "swiglu", "silu", "mish", "leaky_relu", "tanh"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("counts", [[3, 3, 3], [2, 0, 5]])     # batched and unequal counts
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])   # loop and grouped_mm paths
def test_expert_ffn_formula(act, bias, counts, dtype):
    from moeflow.experts import ExpertFFN

    ffn = ExpertFFN(8, 12, 0, 3, act, seed=1, layer_id=2, bias=bias).to(dtype)
    x = torch.randn(sum(counts), 8, dtype=dtype, requires_grad=True)
    y = ffn(x, counts)
    expect = _expert_formula(ffn, x, counts, act)
    torch.testing.assert_close(y, expect)
    g = torch.randn_like(y)
    params = list(ffn.parameters())
    got = torch.autograd.grad(y, [x] + params, g)
    want = torch.autograd.grad(expect, [x] + params, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_expert_biases_are_expert_parameters_with_layout_independent_init():
    from moeflow.parallel.grad_sync import is_expert_param

    cfg = mf.MoEConfig(**BASE, expert_bias=True, activation="swiglu")
    whole = mf.MoELayer(cfg)
    half = mf.MoELayer(cfg, mf.Topology(rank=1, world_size=2, local_size=2, ep_size=2))
    names = {n for n, _ in whole.experts.named_parameters()}
    assert names == {"w1", "w2", "w3", "b1", "b2", "b3"}
    for name in ("b1", "b2", "b3"):
        p = getattr(half.experts, name)
        assert is_expert_param(p)
        torch.testing.assert_close(p, getattr(whole.experts, name)[2:4])   # experts 2 and 3
    # nn.Linear's bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert whole.experts.b1.abs().max() <= 8 ** -0.5 and whole.experts.b1.std() > 0.1
    assert whole.experts.b2.abs().max() <= 16 ** -0.5
    assert not hasattr(mf.MoELayer(mf.MoEConfig(**BASE)).experts, "b1")


def test_model_cost_counts_expert_biases():
    from moeflow.config import ModelConfig
    from moeflow.models import GPT
    from moeflow.models.cost import model_cost

    for act in ("gelu", "swiglu"):
        cfg = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, seq_len=8,
                          moe=dict(num_experts=4, d_expert=8, expert_bias=True, activation=act))
        assert sum(p.numel() for p in GPT(cfg).parameters()) == model_cost(cfg).params_total


@pytest.mark.parametrize("call,built", [
    (dict(top_k=3, capacity_factor=2.0), dict(top_k=3, capacity_factor=2.0)),
    (dict(top_k=1), dict(top_k=1)),                                   # Switch: no renormalising
    (dict(capacity_factor=None), dict(capacity_factor=None)),         # dropless for one call
    (dict(capacity_factor=0.5), dict(capacity_factor=0.5)),           # drops
    (dict(capacity_factor="auto"), dict(capacity_factor=1.25)),
])
def test_per_call_overrides_equal_a_layer_built_with_them(call, built):
    cfg = mf.MoEConfig(**{**BASE, "capacity_factor": 1.0, "seed": 3})
    layer = mf.MoELayer(cfg).double()
    other = mf.MoELayer(cfg.replace(**built)).double()
    modules = list(layer.modules())
    x = torch.randn(10, 8, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa, **call), other(xb)
    torch.testing.assert_close(ya, yb)
    torch.testing.assert_close(layer.aux_loss, other.aux_loss)
    assert layer.stats == other.stats
    (ya.square().sum() + layer.aux_loss).backward()
    (yb.square().sum() + other.aux_loss).backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    for (name, p), q in zip(layer.named_parameters(), other.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    # no rebuild, no lasting change: the next call without overrides uses the config
    assert list(layer.modules()) == modules and layer.cfg == cfg
    torch.testing.assert_close(layer(x), mf.MoELayer(cfg).double()(x))


@pytest.mark.parametrize("call,message", [
    (dict(top_k=0), r"top_k=0 is invalid: must be an integer in \[1, num_experts=4\]"),
    (dict(top_k=5), r"top_k=5 is invalid"),
    (dict(top_k=True), r"top_k=True is invalid"),
    (dict(top_k=2.0), r"top_k=2.0 is invalid"),
    (dict(capacity_factor=0), r"capacity_factor=0 is invalid: must be > 0"),
    (dict(capacity_factor="big"), r"capacity_factor='big' is invalid"),
])
def test_per_call_overrides_are_validated(call, message):
    layer = mf.MoELayer(mf.MoEConfig(**BASE))
    with pytest.raises(ConfigError, match=r"MoELayer\(x, \.\.\.\)\." + message):
        layer(torch.randn(4, 8), **call)


def test_bilevel_router_refuses_a_per_call_top_k():
    cfg = mf.MoEConfig(d_model=8, d_expert=8, num_experts=8, top_k=1, router="bilevel",
                       bilevel_nodes=2)
    layer = mf.MoELayer(cfg)
    with pytest.raises(ConfigError, match=r"top_k=2\) is invalid: with router='bilevel' top_k "
                                          r"is node_top_k x local_top_k = 1 x 1"):
        layer(torch.randn(4, 8), top_k=2)
    layer(torch.randn(4, 8), top_k=1, capacity_factor=None)        # its own k is fine


@pytest.mark.parametrize("router", ["topk", "deepseek_v3"])
def test_router_computes_in_float32_under_bf16_autocast(router):
    """Under bf16 autocast the router's logits and gate weights are float32 and equal the
    layer's routing without autocast (bf16 routing would flip close top-k decisions)."""
    cfg = mf.MoEConfig(d_model=16, d_expert=32, num_experts=8, top_k=2, seed=1,
                       capacity_factor=None, router=router)
    layer = mf.MoELayer(cfg)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    seen = []
    hook = layer.router.register_forward_hook(lambda m, i, out: seen.append(out))
    layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    hook.remove()
    plain, auto = seen
    assert auto.weights.dtype == torch.float32
    assert torch.equal(auto.experts, plain.experts)
    torch.testing.assert_close(auto.weights, plain.weights, rtol=0, atol=0)
