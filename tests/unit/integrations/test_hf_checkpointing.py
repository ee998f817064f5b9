"""A swapped tiny Mixtral under transformers' activation checkpointing, float64 (skipped
without transformers): with ``aux_loss='attach'`` the router gradient and a few training
steps equal the uncheckpointed model's (aux() added by hand), reentrant or not; with
``aux_loss='collect'`` reentrant checkpointing is refused by aux() instead of silently
training no router, and in attach mode aux() refuses (it would count the losses twice)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import moeflow as mf  # noqa: E402
from moeflow.integrations import hf  # noqa: E402
from tests.helpers.hf_cases import make_model, tokens  # noqa: E402

STEPS = 3


def _train(checkpoint: bool | None, aux_loss: str):
    """Losses of STEPS SGD steps, and the first step's gradients; ``checkpoint``: None (off)
    or use_reentrant."""
    model = make_model("mixtral").train()
    aux = hf.replace_moe_blocks(model, aux_loss=aux_loss, aux_loss_coef=0.1)
    if checkpoint is not None:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": checkpoint})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, first = [], None
    for _ in range(STEPS):
        ids = tokens(30)                         # one batch: the loss must fall
        out = model(ids, labels=ids)
        loss = out.loss + aux() if aux_loss == "collect" else out.loss
        losses.append(float(out.loss.detach() + aux.value()))
        opt.zero_grad()
        loss.backward()
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, first


def test_router_gradient_and_training_equal_without_checkpointing():
    ref_losses, ref_grads = _train(None, "collect")
    assert ref_losses[-1] < ref_losses[0]
    routers = [n for n in ref_grads if n.endswith("router.weight")]
    assert len(routers) == 2
    for checkpoint in (True, False):
        for mode in ("attach",) if checkpoint else ("attach", "collect"):
            losses, grads = _train(checkpoint, mode)
            for n, g in ref_grads.items():
                torch.testing.assert_close(grads[n], g, rtol=1e-10, atol=1e-13,
                                           msg=lambda m: f"{checkpoint} {mode} {n}: {m}")
            torch.testing.assert_close(losses, ref_losses, rtol=1e-10, atol=0)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_collect_is_refused_and_attach_refuses_aux():
    model = make_model("mixtral").train()
    aux = hf.replace_moe_blocks(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    ids = tokens(1)
    model(ids, labels=ids)
    with pytest.raises(RuntimeError, match="use_reentrant=True"):
        aux()
    assert aux.value().ndim == 0
    with torch.no_grad():                        # a no_grad forward is not refused
        model(ids)
        aux()
    model = make_model("mixtral").train()
    aux = hf.replace_moe_blocks(model, aux_loss="attach")
    model(ids, labels=ids)
    with pytest.raises(RuntimeError, match="count them twice"):
        aux()
    with pytest.raises(mf.ConfigError, match="aux_loss='both'"):
        hf.replace_moe_blocks(make_model("mixtral"), aux_loss="both")


def test_deepseek_v3_bias_update_unchanged_by_checkpointing():
    """The router counts its loads once per training forward: a checkpoint's recomputation
    replays the first forward's choices and counts nothing (moeflow/plan_record.py), so the
    loads and the bias update are the uncheckpointed ones."""
    from moeflow.routing.deepseek import update_router_biases

    biases, loads = [], []
    for checkpoint in (None, True, False):
        model = make_model("deepseek_v3").train()
        aux = hf.replace_moe_blocks(model, aux_loss="attach")
        if checkpoint is not None:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": checkpoint})
        ids = tokens(3)
        model(ids, labels=ids).loss.backward()
        router = aux.layers[0].router
        loads.append(router.load.clone())
        assert update_router_biases(model) == 1
        biases.append(router.e_score_correction_bias.clone())
    for load, bias in zip(loads[1:], biases[1:]):
        assert torch.equal(load, loads[0])
        assert torch.equal(bias, biases[0])
