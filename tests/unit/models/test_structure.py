"""MoE structures (BigMac): the DCCA equation, r = 1 reduction, parameter formulas, config
errors, dropless defaults, gradient-sync classes, checkpoints, and all-to-all bytes counted on
a real 2-rank run. (Float64 layout parity of each structure is in test_layer_parity.py, via
the structure cases of tests/helpers/parity.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import moeflow as mf
from moeflow import checkpoint
from moeflow.cli import main
from moeflow.config import ConfigError, ModelConfig
from moeflow.models import GPT
from moeflow.models.cost import model_cost, structure_variants
from moeflow.parallel.grad_sync import is_expert_param

BASE = dict(d_model=8, d_expert=12, num_experts=4, top_k=2, seed=3, layer_id=1)
SMALL = ModelConfig(seq_len=16, d_model=16, n_layers=2, n_heads=2, d_ff=32, moe_every=1,
                    moe=dict(num_experts=8, d_expert=16, top_k=4, structure="fine_grained"))


def test_dropless_is_the_default_for_fine_grained_and_bigmac():
    assert mf.MoEConfig(**BASE).capacity_factor == 1.25                       # vanilla
    assert mf.MoEConfig(**BASE, structure="fine_grained").capacity_factor is None
    assert mf.MoEConfig(**BASE, structure="bigmac").capacity_factor is None
    assert mf.MoEConfig(**BASE, structure="bigmac", capacity_factor=2.0).capacity_factor == 2.0
    assert ModelConfig(moe=dict(structure="bigmac")).moe.capacity_factor is None
    big = mf.MoEConfig(**{**BASE, "num_experts": 16, "top_k": 16}, structure="bigmac")
    assert big.top_k == 16 and big.downscale == 0.25                          # k up to E


@pytest.mark.parametrize("change,field,hint", [
    (dict(structure="moe++"), "structure='moe++'", "fine_grained"),
    (dict(structure="bigmac", d_model=10), "downscale_factor=None", "r * d_model is whole"),
    (dict(structure="bigmac", downscale_factor=0.0), "downscale_factor=0.0", "(0, 1]"),
    (dict(structure="bigmac", downscale_factor=-0.5), "downscale_factor=-0.5", "(0, 1]"),
    (dict(structure="bigmac", downscale_factor=1.5), "downscale_factor=1.5", "(0, 1]"),
    (dict(structure="bigmac", d_model=20, downscale_factor=0.75, d_expert=10),
     "d_expert=10", "multiple of 3"),
    (dict(structure="bigmac", d_model=20, downscale_factor=0.4, d_expert=9),
     "d_expert=9", "multiple of 2"),
    (dict(structure="fine_grained", downscale_factor=0.5), "downscale_factor=0.5",
     "structure='bigmac'"),
    (dict(capacity_factor="sometimes"), "capacity_factor='sometimes'", "'auto'"),
])
def test_structure_config_errors(change, field, hint):
    with pytest.raises(ConfigError) as err:
        mf.MoEConfig(**{**BASE, **change})
    assert field in str(err.value) and hint in str(err.value), str(err.value)


def test_model_config_structure_errors_and_cli():
    with pytest.raises(ConfigError, match=r"MoEConfig.downscale_factor=3"):
        ModelConfig(moe=dict(structure="bigmac", downscale_factor=3))
    model = GPT(SMALL.replace(moe={"structure": "bigmac"}))
    layer = model.moe_layers()[0]
    assert layer.dcca is not None and layer.experts.w1.shape == (8, 4, 64)   # (E, rM, F/r)


def _manual_bigmac(layer: mf.MoELayer, x: torch.Tensor) -> torch.Tensor:
    """y = (sum_i g_i E_i(x W_d)) W_u with E(z) = W_down gelu(W_up z), token by token."""
    routing = layer.router(x)
    z = x @ layer.dcca.descend
    out = torch.zeros(x.shape[0], layer.dcca.descend.shape[1], dtype=x.dtype)
    for t in range(x.shape[0]):
        for j in range(routing.experts.shape[1]):
            e = int(routing.experts[t, j])
            out[t] += routing.weights[t, j] * (F.gelu(z[t] @ layer.experts.w1[e])
                                               @ layer.experts.w2[e])
    return out @ layer.dcca.ascend


def test_bigmac_layer_follows_the_dcca_equation():
    layer = mf.MoELayer(mf.MoEConfig(**BASE, structure="bigmac", downscale_factor=0.5)).double()
    x = torch.randn(7, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _manual_bigmac(layer, x), rtol=1e-12, atol=1e-12)
    # the router reads x, not the descended z: scaling W_d changes no routing decision
    with torch.no_grad():
        layer.dcca.descend.mul_(3.0)
    assert torch.equal(layer.router(x).experts, _router_experts(layer, x))


def _router_experts(layer, x):
    return torch.softmax(x @ layer.router.weight, -1).topk(layer.cfg.top_k, -1).indices


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bigmac_r1_identity_projections_is_fine_grained(activation):
    cfg = mf.MoEConfig(**BASE, structure="fine_grained", activation=activation)
    fine = mf.MoELayer(cfg).double()
    big = mf.MoELayer(cfg.replace(structure="bigmac", downscale_factor=1.0)).double()
    with torch.no_grad():
        big.dcca.descend.copy_(torch.eye(8))
        big.dcca.ascend.copy_(torch.eye(8))
    for name, p in fine.named_parameters():            # same seeds, same shapes at r = 1
        assert torch.equal(p, dict(big.named_parameters())[name]), name
    x = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y1, y2 = fine(x), big(x2)
    torch.testing.assert_close(y2, y1, rtol=1e-13, atol=1e-14)
    (y1.square().sum() + fine.aux_loss).backward()
    (y2.square().sum() + big.aux_loss).backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-12, atol=1e-13)
    for name, p in fine.named_parameters():
        torch.testing.assert_close(dict(big.named_parameters())[name].grad, p.grad,
                                   rtol=1e-12, atol=1e-13)


def test_parameter_counts_equal_the_formulas():
    for cfg in structure_variants(SMALL, granularity=2) + structure_variants(
            model_cost_preset(), granularity=4):
        model = GPT(cfg)
        cost = model_cost(cfg)
        assert sum(p.numel() for p in model.parameters()) == cost.params_total, cfg.moe.structure
        layer = model.moe_layers()[0]
        assert sum(p.numel() for p in layer.parameters()) == cost.params_per_moe_layer
    fine, big = (model_cost(c) for c in structure_variants(SMALL, granularity=2)[1:])
    # same expert parameters; BigMac adds 2 r M^2 per layer and moves r times the bytes
    assert big.params_per_moe_layer - fine.params_per_moe_layer == 2 * 16 * 4
    assert big.a2a_bytes_per_token == 0.25 * fine.a2a_bytes_per_token


def model_cost_preset() -> ModelConfig:
    return mf.model_preset("tiny", moe=dict(structure="vanilla"))


def test_projections_are_replicated_and_experts_sharded():
    layer = mf.MoELayer(mf.MoEConfig(**BASE, structure="bigmac", downscale_factor=0.5))
    kinds = {n: is_expert_param(p) for n, p in layer.named_parameters()}
    assert kinds == {"router.weight": False, "dcca.descend": False, "dcca.ascend": False,
                     "experts.w1": True, "experts.w2": True}


def test_bigmac_checkpoint_uses_global_expert_keys(tmp_path):
    """Saved by one rank, loaded into rank 1 of a 2-rank layout: experts by global id, the
    replicated projections whole."""
    cfg = SMALL.replace(moe={"structure": "bigmac"})
    full = GPT(cfg)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.5)
    checkpoint.save(str(tmp_path / "ck"), full, torch.optim.AdamW(full.parameters()), 3)
    keys = checkpoint.checkpoint_state(full, None, torch.tensor(0))
    assert "model/blocks.0.ffn.dcca.descend" in keys
    assert "model/blocks.0.ffn.experts.w1/expert/7" in keys
    half = GPT(cfg, mf.Topology(rank=1, world_size=2, local_size=2, ep_size=2))
    assert checkpoint.load(str(tmp_path / "ck"), half, None) == 3
    f = dict(full.named_parameters())
    for name, p in half.named_parameters():
        expect = f[name][4:8] if ".experts." in name else f[name]
        assert torch.equal(p, expect), name


def test_model_info_cli(tmp_path, capsys):
    out = tmp_path / "info.json"
    assert main(["model-info", "--set", "moe.structure=fine_grained", "--set",
                 "moe.num_experts=32", "--set", "moe.d_expert=64", "--set", "moe.top_k=8",
                 "--ep", "2", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "bigmac" in table and "-75.00%" in table
    rows = {r["structure"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["vanilla"]["num_experts"] == 8 and rows["vanilla"]["top_k"] == 2
    assert rows["bigmac"]["comm_width"] == 32 and rows["bigmac"]["expert_hidden"] == 256
    assert rows["bigmac"]["a2a_bytes_per_token"] * 4 == rows["fine_grained"][
        "a2a_bytes_per_token"]
    with pytest.raises(SystemExit):
        main(["model-info", "--granularity", "3", "--set", "moe.structure=fine_grained"])
    assert "granularity=3" in capsys.readouterr().err


@pytest.mark.multirank
def test_counted_all_to_all_bytes_on_two_ranks(tmp_path, capsys):
    """The bytes the layer hands to the all-to-all equal the formula, and BigMac's are r times
    the fine-grained ones (one real 2-rank gloo run through the bench command)."""
    out = tmp_path / "bigmac.json"
    assert main(["bench", "bigmac", "--nproc", "2", "--tokens", "40", "--d-model", "16",
                 "--d-expert", "8", "--num-experts", "8", "--top-k", "2,8", "--warmup", "0",
                 "--reps", "1", "--structures", "vanilla,fine_grained,bigmac",
                 "--out", str(out), "--timeout", "120"]) == 0
    assert "speedup" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 6 and all(r["a2a_bytes_match"] for r in rows)
    by = {(r["structure"], r["top_k"]): r for r in rows}
    for k in (2, 8):
        fine, big = by[("fine_grained", k)], by[("bigmac", k)]
        assert fine["a2a_bytes_per_token"] == 4 * k * 16 * 4            # 4 k M float32
        assert big["a2a_bytes_per_token"] == 0.25 * fine["a2a_bytes_per_token"]
        assert 0 < big["a2a_offrank_bytes_per_token"] < big["a2a_bytes_per_token"]
    assert by[("vanilla", 2)]["capacity_factor"] == 1.25                  # padded buffer


def test_bigmac_initialisation_is_layout_independent():
    cfg = SMALL.replace(moe={"structure": "bigmac"})
    full = dict(GPT(cfg).named_parameters())
    half = GPT(cfg, mf.Topology(rank=1, world_size=2, local_size=2, ep_size=2))
    for name, p in half.named_parameters():
        expect = full[name][4:8] if ".experts." in name else full[name]
        assert torch.equal(p, expect), name
    other = GPT(cfg.replace(seed=1))
    assert not torch.equal(other.blocks[0].ffn.dcca.descend, full["blocks.0.ffn.dcca.descend"])


def test_codecs_apply_unchanged_to_bigmac():
    """A registered codec sees the narrow (r * d_model) payload and changes nothing else."""
    seen = []

    @mf.register_codec("test_structure_halfs")
    class Halfs(mf.Codec):
        lossless = False

        def encode(self, x):
            seen.append(x.shape[1])
            return [x.half()]

        def decode(self, payloads, dtype):
            return payloads[0].to(dtype)

        def wire_bytes(self, rows, cols, dtype):
            return 2 * rows * cols

    cfg = mf.MoEConfig(**BASE, structure="bigmac", downscale_factor=0.5)
    exact, coded = mf.MoELayer(cfg), mf.MoELayer(cfg.replace(codec="test_structure_halfs"))
    x = torch.randn(6, 8)
    torch.testing.assert_close(coded(x), exact(x), rtol=2e-2, atol=2e-3)
    assert seen == [4, 4]                                  # dispatch and combine at r * M
