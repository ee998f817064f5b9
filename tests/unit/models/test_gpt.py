"""The MoE GPT: shapes, causality, layout-independent initialisation, the aux loss."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.config import ModelConfig
from moeflow.models import GPT

CFG = ModelConfig(seq_len=16, d_model=16, n_layers=2, n_heads=2, d_ff=32, moe_every=2,
                  moe=dict(num_experts=4, d_expert=16))


def test_forward_loss_and_aux():
    model = GPT(CFG)
    idx = torch.randint(0, 256, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 256)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3
    assert len(model.moe_layers()) == 1 and model.aux_loss.item() > 0
    with pytest.raises(ValueError, match="seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_causal_when_dropless():
    """Dropless routing is per token, so the model is causal. (With a capacity, whether a
    token's second choice is dropped depends on the first choices of every token in the
    batch, later ones included: GShard-style capacity is not causal, by construction.)"""
    model = GPT(CFG.replace(moe={"capacity_factor": None})).eval()
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    torch.testing.assert_close(model(a)[0][:, :10], model(b)[0][:, :10])


def test_initialisation_is_layout_independent():
    """The experts a rank would hold are bit-equal to the same experts of a 1-rank model."""
    full = GPT(CFG)
    half = GPT(CFG, mf.Topology(rank=1, world_size=2, local_size=2, ep_size=2))
    f, h = dict(full.named_parameters()), dict(half.named_parameters())
    for name, p in h.items():
        expect = f[name][2:4] if ".experts." in name else f[name]
        assert torch.equal(p, expect), name
    other = GPT(CFG.replace(seed=1))
    assert not torch.equal(other.tok.weight, full.tok.weight)
