"""moeflow.integrations.hf against transformers (skipped without it), float64, tiny configs:
each of the six MoE blocks (outputs, input and weight gradients), to_hf round trips, swapped
full models' logits, save_pretrained / from_pretrained both ways (also from 2 expert-parallel
ranks), the config recipe and its balancing-loss scale."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import moeflow as mf  # noqa: E402
from moeflow.integrations import hf  # noqa: E402
from moeflow.integrations.hf.architectures import hf_from_moeflow  # noqa: E402
from tests.helpers import hf_cases  # noqa: E402
from tests.helpers.hf_cases import float64_routers, make_model, tokens  # noqa: E402

NAMES = list(hf_cases.CONFIGS)
TOL = dict(rtol=1e-10, atol=1e-12)


def _first_block(model):
    return next(m for m in model.modules() if hf.architecture_of(m) is not None)


def _call(block, x):
    y = block(x)
    return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("name", NAMES)
def test_block_matches_transformers(name):
    block = _first_block(make_model(name)).train()
    layer = hf.from_hf(block)
    assert layer.cfg.capacity_factor is None
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with float64_routers():
        want = _call(block, xa)
    got = layer(xb)
    torch.testing.assert_close(got, want, **TOL)
    (want * g).sum().backward()
    (got * g).sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, **TOL)
    # moeflow's weight gradients, mapped by the same (linear) weight map, are transformers'
    grads = {k: (p.grad if isinstance(p, torch.nn.Parameter) else p)
             for k, p in list(layer.named_parameters()) + list(layer.named_buffers())
             if k != "router.load"}
    hf_params = dict(block.named_parameters())
    mapped = hf_from_moeflow(hf.architecture_of(block), grads)
    checked = 0
    for k, p in hf_params.items():
        if k in mapped and p.grad is not None:
            torch.testing.assert_close(mapped[k], p.grad, **TOL, msg=lambda m: f"{k}: {m}")
            checked += 1
    assert checked == len(hf_params), (checked, sorted(hf_params))


@pytest.mark.parametrize("name", NAMES)
def test_to_hf_round_trips_exactly(name):
    block = _first_block(make_model(name))
    layer = hf.from_hf(block)
    other = _first_block(make_model(name, seed=5))
    assert not all(torch.equal(a, b) for a, b in zip(block.state_dict().values(),
                                                       other.state_dict().values()))
    hf.to_hf(layer, other)
    for k, v in block.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_swapped_model_matches_logits(name):
    model = make_model(name)
    ids = tokens(0)
    with torch.no_grad(), float64_routers():
        want = model(ids).logits
        aux = hf.replace_moe_blocks(model)
        got = model(ids).logits
    assert len(aux) == (2 if name == "mixtral" else 1)
    assert not any(hf.architecture_of(m) for m in model.modules())
    torch.testing.assert_close(got, want, **TOL)
    assert aux().ndim == 0


def test_swapped_model_trains_and_aux_reaches_router():
    model = make_model("mixtral").train()
    aux = hf.replace_moe_blocks(model)
    ids = tokens(1)
    out = model(ids, labels=ids)
    (out.loss + aux()).backward()
    assert all(layer.router.weight.grad.abs().sum() > 0 for layer in aux.layers)


def test_save_pretrained_round_trip(tmp_path):
    """moeflow -> a checkpoint of the original class -> transformers, and back."""
    from transformers import MixtralForCausalLM

    model = make_model("mixtral")
    aux = hf.replace_moe_blocks(model)
    with torch.no_grad():
        for layer in aux.layers:                   # weights moeflow "trained"
            layer.experts.w1.mul_(1.5)
            layer.router.weight.add_(0.1)
    ids = tokens(2)
    with torch.no_grad(), float64_routers():
        want = model(ids).logits
    hf.save_pretrained(model, str(tmp_path))
    loaded = MixtralForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64,
                                                experts_implementation="eager")
    with torch.no_grad(), float64_routers():
        torch.testing.assert_close(loaded(ids).logits, want, **TOL)
    fresh = make_model("mixtral", seed=9)       # the reverse: a transformers state dict in
    hf.replace_moe_blocks(fresh)
    hf.load_hf_state_dict(fresh, loaded.state_dict())
    with torch.no_grad(), float64_routers():
        torch.testing.assert_close(fresh(ids).logits, want, **TOL)
    sd = hf.hf_state_dict(fresh)
    assert sd.keys() == loaded.state_dict().keys()


@pytest.mark.multirank
def test_expert_parallel_run_saves_a_transformers_checkpoint(tmp_path):
    from transformers import MixtralForCausalLM

    from moeflow.launch import launch_local

    out = launch_local(hf_cases.ep_worker, 2, "mixtral", str(tmp_path), timeout_s=180)
    for rank in (0, 1):
        assert out[rank]["num_local"] == 2                  # 4 experts over 2 ranks
        torch.testing.assert_close(out[rank]["got"], out[rank]["want"], **TOL)
    loaded = MixtralForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64,
                                                experts_implementation="eager")
    with torch.no_grad(), float64_routers():
        # both ranks' perturbed experts (by global id) are in the checkpoint
        torch.testing.assert_close(loaded(tokens(20)).logits, out[0]["after"], **TOL)
        assert not torch.allclose(loaded(tokens(20)).logits,
                                  make_model("mixtral")(tokens(20)).logits)


@pytest.mark.parametrize("name", NAMES)
def test_recipe(name):
    config = hf_cases.CONFIGS[name]()
    cfg = hf.moe_config_from_hf(config, codec="fp16")
    assert cfg.capacity_factor is None and cfg.codec == "fp16" and cfg.d_model == 16
    assert cfg.activation == ("clamped_swiglu" if name == "gpt_oss" else "swiglu")
    block = _first_block(make_model(name))
    layer = hf.from_hf(block, config=config)
    for field in ("num_experts", "top_k", "activation", "renormalize", "router",
                  "aux_loss_coef", "expert_bias"):
        assert getattr(layer.cfg, field) == getattr(cfg, field), field
    assert layer.cfg.shared_hidden == cfg.shared_hidden
    if name == "deepseek_v3":
        assert cfg.router_options["n_group"] == 4 and cfg.aux_loss_coef == 0
        assert cfg.num_shared_experts == 2 and cfg.shared_expert_hidden == 12
    if name == "qwen2_moe":
        assert cfg.shared_expert_gate and cfg.shared_expert_hidden == 20


def test_balancing_loss_scale_matches_transformers():
    """One MoE layer (L = 1): the recipe's aux_loss equals router_aux_loss_coef times
    transformers' load_balancing_loss_func, which is top_k times moeflow's balance loss."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = hf_cases.CONFIGS["mixtral"]()
    config.num_hidden_layers = 1
    block = _first_block(make_model("mixtral"))
    layer = hf.from_hf(block, config=config)
    x = torch.randn(12, 16, dtype=torch.float64)
    layer(x)
    logits = (x @ layer.router.weight).detach()
    want = load_balancing_loss_func((logits,), 4, 2).double()   # computed in float32 there
    torch.testing.assert_close(layer.stats["balance_loss"] * 2, float(want), rtol=1e-6, atol=0)
    torch.testing.assert_close(layer.aux_loss.detach(), config.router_aux_loss_coef * want,
                               rtol=1e-6, atol=0)


def test_clear_errors():
    config = hf_cases.CONFIGS["mixtral"]()
    config.hidden_act = "gelu"
    with pytest.raises(mf.ConfigError, match="hidden_act='gelu'"):
        hf.moe_config_from_hf(config)
    with pytest.raises(mf.ConfigError, match="not a supported transformers MoE block"):
        hf.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(mf.ConfigError, match="no supported MoE block"):
        hf.replace_moe_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
