"""DeepSeek-V3 routing (routing/deepseek.py) against its formulas, its options' errors, and the
auxiliary-loss-free bias update (single process and 2 ranks). Layout parity runs with the other
cases (``deepseek_v3_groups`` in tests/helpers/parity.py)."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.config import ConfigError
from moeflow.launch import launch_local


def _cfg(**kw):
    base = dict(d_model=16, d_expert=32, num_experts=8, top_k=2, capacity_factor=None,
                router="deepseek_v3", seed=3)
    opts = kw.pop("router_options", {})
    return mf.MoEConfig(**{**base, **kw}, router_options=opts)


def _reference(x, w, bias, n_group, topk_group, k, norm, scale):
    """transformers' DeepseekV3TopkRouter + DeepseekV3MoE.route_tokens_to_experts, written
    out token by token in float64."""
    scores = torch.sigmoid(x @ w.detach())
    experts, weights = [], []
    E = w.shape[1]
    size = E // n_group
    for s in scores:
        choice = s + bias
        group_score = [sorted(choice[g * size:(g + 1) * size].tolist())[-2:] for g in
                       range(n_group)]
        group_score = torch.tensor([sum(v) for v in group_score], dtype=torch.float64)
        keep = set(group_score.topk(topk_group).indices.tolist())
        masked = torch.tensor([float(choice[e]) if e // size in keep else float("-inf")
                               for e in range(E)], dtype=torch.float64)
        idx = masked.topk(k).indices
        wt = s[idx]
        if norm:
            wt = wt / (wt.sum() + 1e-20)
        experts.append(idx)
        weights.append(wt * scale)
    return torch.stack(experts), torch.stack(weights)


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (4, 1, False)])
def test_routing_matches_the_formulas(n_group, topk_group, norm):
    cfg = _cfg(router_options=dict(n_group=n_group, topk_group=topk_group,
                                   routed_scaling_factor=2.5),
               renormalize=None if norm else False)
    layer = mf.MoELayer(cfg).double()
    with torch.no_grad():
        layer.router.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    x = torch.randn(20, 16, dtype=torch.float64)
    got = layer.router(x)
    exp, wts = _reference(x, layer.router.weight, layer.router.e_score_correction_bias,
                          n_group, topk_group, 2, norm, 2.5)
    assert torch.equal(got.experts, exp)
    torch.testing.assert_close(got.weights, wts, rtol=1e-12, atol=1e-12)


def test_bias_steers_selection_not_weights():
    layer = mf.MoELayer(_cfg(top_k=1)).double()
    x = torch.randn(12, 16, dtype=torch.float64)
    with torch.no_grad():
        layer.router.e_score_correction_bias[5] = 10.0
    r = layer.router(x)
    assert (r.experts[:, 0] == 5).all()
    # weight: the unbiased sigmoid score, renormalised over the k = 1 choice
    torch.testing.assert_close(r.weights[:, 0], torch.ones(12, dtype=torch.float64))
    layer2 = mf.MoELayer(_cfg(top_k=1, renormalize=False)).double()
    layer2.load_state_dict(layer.state_dict())
    r2 = layer2.router(x)
    torch.testing.assert_close(r2.weights[:, 0],
                               torch.sigmoid(x @ layer.router.weight)[:, 5])


def test_group_limit_bounds_the_groups_per_token():
    layer = mf.MoELayer(_cfg(top_k=4, router_options=dict(n_group=4, topk_group=2)))
    r = layer.router(torch.randn(64, 16))
    groups = r.experts // 2
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_bias_update_follows_the_rule_and_balances():
    """b_i += gamma * sign(mean load - load_i): overloaded experts lose bias; on a skewed
    input the max/mean load falls with no auxiliary loss."""
    cfg = _cfg(aux_loss_coef=0.0, router_options=dict(bias_update_speed=0.002))
    layer = mf.MoELayer(cfg)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen) + torch.randn(16, generator=gen)
    ratios = []
    for step in range(60):
        layer.router(x)
        load = layer.router.load.clone()
        before = layer.router.e_score_correction_bias.clone()
        assert mf.update_router_biases(layer) == 1
        torch.testing.assert_close(layer.router.e_score_correction_bias,
                                   before + 0.002 * torch.sign(load.mean() - load))
        assert layer.router.load.sum() == 0
        ratios.append(float(load.max() / load.mean()))
    assert ratios[0] > 2.0 and max(ratios[-10:]) < 1.3, ratios     # 2.19 -> 1.12-1.20 here


def test_bias_is_saved_and_the_load_is_not():
    layer = mf.MoELayer(_cfg())
    keys = layer.state_dict().keys()
    assert "router.e_score_correction_bias" in keys and "router.load" not in keys


def test_bias_survives_a_moeflow_checkpoint(tmp_path):
    """moeflow.checkpoint (DCP) saves persistent buffers too: the bias resumes with training."""
    from moeflow import checkpoint

    layer = mf.MoELayer(_cfg())
    with torch.no_grad():
        layer.router.e_score_correction_bias.copy_(torch.arange(8.0) / 10)
    opt = torch.optim.AdamW(layer.parameters())
    checkpoint.save(str(tmp_path / "c"), layer, opt, 3)
    fresh = mf.MoELayer(_cfg())
    assert checkpoint.load(str(tmp_path / "c"), fresh, torch.optim.AdamW(fresh.parameters())) == 3
    assert torch.equal(fresh.router.e_score_correction_bias, torch.arange(8.0) / 10)
    # a checkpoint written without buffers (before they were saved) still loads; the bias
    # keeps its value
    plain = mf.MoELayer(_cfg().replace(router="topk", router_options=None))
    checkpoint.save(str(tmp_path / "old"), plain, None, 1)
    assert checkpoint.load(str(tmp_path / "old"), fresh, None) == 1
    assert torch.equal(fresh.router.weight, plain.router.weight)
    assert torch.equal(fresh.router.e_score_correction_bias, torch.arange(8.0) / 10)


@pytest.mark.parametrize("opts,match", [
    (dict(n_grop=2), "did you mean 'n_group'"),
    (dict(n_group=3), "pick a divisor of num_experts"),
    (dict(n_group=2, topk_group=3), "at most n_group=2"),
    (dict(n_group=8), "at least 2 experts"),
    (dict(bias_update_speed=-1), "must be a number >= 0"),
])
def test_bad_options_are_clear(opts, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(router_options=opts)
    with pytest.raises(ConfigError, match="router 'topk' does not take"):
        mf.MoEConfig(d_model=8, d_expert=8, num_experts=4, router_options=dict(n_group=2))


def bias_worker() -> dict:
    topo = mf.Topology.from_env()
    layer = mf.MoELayer(_cfg(router_options=dict(bias_update_speed=0.01)), topo)
    x = torch.randn(6 + 5 * topo.rank, 16, generator=torch.Generator().manual_seed(topo.rank))
    layer.router(x)
    mf.update_router_biases(layer, topo)
    return {"bias": layer.router.e_score_correction_bias.clone(), "x": x}


@pytest.mark.multirank
def test_bias_is_the_same_on_every_rank_and_layout_independent():
    res = launch_local(bias_worker, 2, timeout_s=120)
    assert torch.equal(res[0]["bias"], res[1]["bias"])
    ref = mf.MoELayer(_cfg(router_options=dict(bias_update_speed=0.01)))
    ref.router(torch.cat([res[0]["x"], res[1]["x"]]))
    mf.update_router_biases(ref)
    assert torch.equal(ref.router.e_score_correction_bias, res[0]["bias"])
