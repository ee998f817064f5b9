"""moeflow/plan_record.py: a checkpointed MoE layer's recomputation replays the first forward's
routing choices, plan (counts exchanged once), tuner choice and call settings, under reentrant
and non-reentrant torch.utils.checkpoint, at r = 1 and r = 4 (one process, float64)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp

import moeflow as mf
import moeflow.schedule.pipeline as pipeline
from moeflow import plan_record
from moeflow.schedule import SCHEDULERS

R = {"r1": {}, "r4": dict(schedule="pipelined", pipeline_degree=4)}


def _layer(**kw) -> mf.MoELayer:
    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, capacity_factor=1.0,
                       **kw)
    return mf.MoELayer(cfg, attach_aux_loss=True).double().train()


def _x() -> torch.Tensor:
    return torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                       requires_grad=True)


def _grads(layer, x) -> dict:
    out = {n: p.grad.clone() for n, p in layer.named_parameters()}
    out["input"] = x.grad.clone()
    return out


@pytest.mark.parametrize("r", list(R))
@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputation_routes_with_the_recorded_choices_and_exchanges_no_counts(
        monkeypatch, r, reentrant):
    layer = _layer(**R[r])
    calls, exchanges = [], [0]
    layer.router.register_forward_hook(
        lambda _m, args, kwargs, out: calls.append((kwargs.get("chosen"), out.experts)),
        with_kwargs=True)
    exchange = pipeline.exchange_counts

    def counting(*a, **k):
        exchanges[0] += 1
        return exchange(*a, **k)

    monkeypatch.setattr(pipeline, "exchange_counts", counting)
    x = _x()
    cp.checkpoint(layer, x, use_reentrant=reentrant).square().sum().backward()
    assert len(calls) == 2 and exchanges[0] == 1
    (first_chosen, first), (chosen, again) = calls
    assert first_chosen is None and torch.equal(chosen, first) and torch.equal(again, first)


def test_recomputation_keeps_the_call_settings_of_its_forward(monkeypatch):
    """A re-tune between the forward and its recomputation (another micro-batch's forward
    can re-tune) does not reach the recomputation: it runs with the recorded cfg and
    scheduler (r = 1 here, although the layer now says r = 4), and the layer's settings are
    left as they were."""
    ref_layer, layer = _layer(), _layer()
    x0 = _x()
    ref_layer(x0).square().sum().backward()
    degrees = []
    build = pipeline.ChunkPlan.build

    def spy(plan, r, device):
        degrees.append(r)
        return build(plan, r, device)

    monkeypatch.setattr(pipeline.ChunkPlan, "build", staticmethod(spy))
    x = _x()
    y = cp.checkpoint(layer, x, use_reentrant=False)
    retuned = layer.cfg.replace(pipeline_degree=4, schedule="pipelined")
    layer.cfg, layer.scheduler = retuned, SCHEDULERS["pipelined"]()
    y.square().sum().backward()
    assert degrees == [1, 1]
    assert layer.cfg is retuned
    got, ref = _grads(layer, x), _grads(ref_layer, x0)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-12, atol=1e-15, msg=n)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_layer_called_twice_in_one_region_replays_each_call(reentrant):
    layer, ref_layer = _layer(), _layer()

    def twice(m, x):
        return m(torch.tanh(m(x)))

    x0, x = _x(), _x()
    twice(ref_layer, x0).square().sum().backward()
    cp.checkpoint(lambda t: twice(layer, t), x, use_reentrant=reentrant).square().sum() \
        .backward()
    got, ref = _grads(layer, x), _grads(ref_layer, x0)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-12, atol=1e-15, msg=n)


def test_region_is_found_in_forward_and_recomputation():
    seen = []

    def f(t):
        seen.append(plan_record.region())
        return t.sin()

    assert plan_record.region() is None
    x = torch.randn(3, requires_grad=True)
    for reentrant in (False, True):
        seen.clear()
        cp.checkpoint(f, x, use_reentrant=reentrant).sum().backward()
        (mode0, key0), (mode1, key1) = seen
        assert (mode0, mode1) == ("forward", "recompute") and key0 is key1, reentrant


def test_deepseek_router_counts_its_loads_once_under_recomputation():
    layer = _layer(router="deepseek_v3")
    cp.checkpoint(layer, _x(), use_reentrant=False).square().sum().backward()
    assert float(layer.router.load.sum()) == 16 * 2
