"""Activations and expert modules as registries; GPT-OSS's clamped SwiGLU and router bias.
(Layout parity of the GPT-OSS pieces: case ``gpt_oss_pieces`` in tests/helpers/parity.py.)"""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.experts.activations import ACTIVATIONS, Activation, build_activation
from moeflow.experts.ffn import EXPERTS, ExpertFFN

BASE = dict(d_model=8, d_expert=12, num_experts=4, top_k=2)


def test_clamped_swiglu_is_gpt_oss_formula():
    """transformers' GptOssExperts._apply_gate, written out: gate clamped above, up clamped
    both sides, (up + 1) * gate * sigmoid(alpha * gate)."""
    act = build_activation("clamped_swiglu", {"limit": 1.0, "alpha": 2.0})
    h = torch.tensor([-3.0, -0.5, 0.5, 3.0], dtype=torch.float64)
    up = torch.tensor([-3.0, 0.25, 2.0, -0.5], dtype=torch.float64)
    g = torch.tensor([-3.0, -0.5, 0.5, 1.0], dtype=torch.float64)     # min(h, 1)
    u = torch.tensor([-1.0, 0.25, 1.0, -0.5], dtype=torch.float64)    # clamp(up, -1, 1)
    torch.testing.assert_close(act(h, up), (u + 1) * g * torch.sigmoid(2.0 * g))
    assert build_activation("clamped_swiglu").options == {"alpha": 1.702, "limit": 7.0}


def test_clamped_swiglu_layer_uses_three_projections_and_options():
    cfg = mf.MoEConfig(**BASE, activation="clamped_swiglu", expert_bias=True,
                       activation_options={"limit": 0.5})
    assert cfg.activation_options == {"alpha": 1.702, "limit": 0.5}
    layer = mf.MoELayer(cfg).double()
    assert layer.experts.w3.shape == layer.experts.w1.shape and hasattr(layer.experts, "b3")
    x = torch.randn(5, 8, dtype=torch.float64)
    e = layer.experts
    want = (build_activation("clamped_swiglu", {"limit": 0.5})(x @ e.w1[1] + e.b1[1],
                                                               x @ e.w3[1] + e.b3[1])
            @ e.w2[1] + e.b2[1])
    got = e(torch.cat([x[:0], x]), [0, 5, 0, 0])
    torch.testing.assert_close(got, want)


def test_router_bias_adds_to_the_logits():
    layer = mf.MoELayer(mf.MoEConfig(**BASE, router_options={"bias": True})).double()
    assert layer.router.bias.shape == (4,)
    x = torch.randn(6, 8, dtype=torch.float64)
    with torch.no_grad():
        layer.router.bias.copy_(torch.tensor([0.0, 50.0, 0.0, 49.0]))
    r = layer.router(x)
    assert (r.experts[:, 0] == 1).all() and (r.experts[:, 1] == 3).all()
    assert mf.MoELayer(mf.MoEConfig(**BASE)).router.bias is None


@pytest.mark.parametrize("kw,match", [
    (dict(activation="clamped_swiglo"), "did you mean 'clamped_swiglu'"),
    (dict(activation="swiglu", activation_options={"limit": 1.0}),
     "activation 'swiglu' does not take"),
    (dict(activation="clamped_swiglu", activation_options={"limt": 1.0}),
     "did you mean 'limit'"),
    (dict(activation="clamped_swiglu", activation_options={"limit": -1}), "must be a number > 0"),
    (dict(activation="silu", activation_options={"a": 1}), "takes no options"),
    (dict(expert_module="fnn"), "did you mean 'ffn'"),
    (dict(router_options={"bias": 1}), "router_options\\['bias'\\]=1"),
    (dict(router_options={"bais": True}), "did you mean 'bias'"),
])
def test_errors_name_the_field_and_the_fix(kw, match):
    with pytest.raises(mf.ConfigError, match=match):
        mf.MoEConfig(**BASE, **kw)


def test_user_activation_and_expert_module_plug_in():
    from moeflow.experts.activations import register_activation
    from moeflow.experts.ffn import register_experts

    @register_activation("test_squared_relu")
    class SquaredReLU(Activation):
        def __call__(self, h, up=None):
            return torch.relu(h) ** 2

    @register_experts("test_counting_ffn")
    class CountingFFN(ExpertFFN):
        calls = 0

        def forward(self, x, counts, offsets=None):
            type(self).calls += 1
            return super().forward(x, counts, offsets)

    try:
        cfg = mf.MoEConfig(**BASE, activation="test_squared_relu",
                           expert_module="test_counting_ffn")
        layer = mf.MoELayer(cfg)
        assert isinstance(layer.experts, CountingFFN)
        assert layer(torch.randn(3, 8)).shape == (3, 8) and CountingFFN.calls == 1
        with pytest.raises(TypeError, match="must subclass"):
            register_experts("test_bad")(torch.nn.Linear)
    finally:
        ACTIVATIONS.pop("test_squared_relu")
        EXPERTS.pop("test_counting_ffn")


def test_functional_activations_still_work():
    layer = mf.MoELayer(mf.MoEConfig(**BASE, activation="mish"))
    assert layer.experts.act.name == "mish"
    assert layer(torch.randn(3, 8)).shape == (3, 8)
