"""Rank body of tests/multirank/test_autotune_placement.py (importable by spawned ranks):
``MoEConfig(placement="auto")`` on 4 gloo ranks seen as 2 nodes x 2 (and as 1 node of 4), in
float64: the tuner measures ``node_dedup`` beside expert parallelism (DeepEP's inter-node
dispatch against ScheMoE's all-to-all), the step after tuning equals the one-process
reference, and a checkpoint taken with either strategy loads into the other."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from moeflow import MoELayer, Topology, checkpoint
from moeflow.autotune import tuner
from tests.helpers import parity

CASE = "dropless_k2"


def _tune_and_keep(seen: dict):
    """A ``before`` hook for :func:`parity.run_rank`: tune, and keep what was chosen."""
    def before(layer: MoELayer, x: torch.Tensor) -> None:
        layer.tune(x)
        seen.update(choice=layer.tuned.as_dict(), strategy=layer.strategy.name,
                    placement=layer.cfg.placement)
    return before


def _injected(dedup_s: float, ep_s: float):
    """``tuner._measure`` that runs every candidate for real (the strategy swap, the steps,
    the restore) but reports the given seconds per placement: the same numbers on every
    rank, so the pick rule decides as it would on those timings."""
    real = tuner._measure

    def measure(layer, cfg, x, reps, clock, warmup=None):
        if real(layer, cfg, x, reps, clock, warmup) is None:
            return None
        return dedup_s if cfg.placement == "node_dedup" else ep_s
    return measure


def _injected_step(dedup_s: float, ep_s: float):
    """``tuner._time_step`` (the paired placement screen's steps) likewise: each step run
    for real, the given seconds reported."""
    real = tuner._time_step

    def step(layer, cfg, x, clock):
        real(layer, cfg, x, clock)
        return dedup_s if cfg.placement == "node_dedup" else ep_s
    return step


def _inject(dedup_s: float, ep_s: float) -> None:
    tuner._measure = _injected(dedup_s, ep_s)
    tuner._time_step = _injected_step(dedup_s, ep_s)


def _grads(layer: MoELayer, x: torch.Tensor, g: torch.Tensor, checkpointed: bool,
           between=None) -> dict:
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    if checkpointed:
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    else:
        y = layer(x)
    if between is not None:
        between()
    (y * g).sum().backward()
    return {"y": y.detach(), "x": x.grad,
            **{n: p.grad.clone() for n, p in layer.named_parameters()}}


def _replay_after_retune(topo: Topology) -> dict:
    """(plain step, checkpointed step with a re-tune to "ep" before its backward) of a layer
    whose tuner kept node_dedup (timings injected by the caller), and the strategy after."""
    import dataclasses

    layer = parity.make_layer(CASE, topo, placement="auto", autotune_budget_s=None)
    x, g = parity.make_batch(CASE, topo.rank)
    layer.tune(x)
    plain = _grads(layer, x, g, False)
    to_ep = dataclasses.replace(layer.tuned, placement="ep")
    ckpt = _grads(layer, x, g, True, lambda: layer.set_tuned(to_ep))
    return {"plain": plain, "checkpointed": ckpt, "strategy_after": layer.strategy.name}


def worker(ckpt_dir: str) -> dict:
    torch.set_default_dtype(torch.float64)
    two_nodes = Topology.from_env(local_size=2)
    out: dict = {}
    # 1. measured timings (whatever wins): both candidates measured, the same choice on every
    #    rank, and the step after tuning equals the reference
    seen: dict = {}
    out["measured"] = dict(parity.run_rank(CASE, two_nodes, _tune_and_keep(seen),
                                           placement="auto", autotune_budget_s=None), **seen)
    real, real_step = tuner._measure, tuner._time_step
    try:
        # 2. node_dedup 10x faster: kept, and the step after tuning (with node_dedup) equals
        #    the reference: tuning changed no parameter, gradient or random state
        _inject(0.001, 0.010)
        seen = {}
        out["dedup_wins"] = dict(parity.run_rank(CASE, two_nodes, _tune_and_keep(seen),
                                                 placement="auto", autotune_budget_s=None,
                                                 schedule="auto", pipeline_degree="auto"),
                                 **seen)
        # 2b. under an activation checkpoint, a re-tune to "ep" between the forward and its
        #     recomputation: the recomputation replays the forward's strategy (node_dedup)
        out["replay"] = _replay_after_retune(two_nodes)
        # 3. node_dedup 3 % faster (within SIMPLER_MARGIN): expert parallelism is kept
        _inject(0.0097, 0.010)
        seen = {}
        out["within_margin"] = dict(parity.run_rank(CASE, two_nodes, _tune_and_keep(seen),
                                                    placement="auto", autotune_budget_s=None),
                                    **seen)
        # 4. checkpoints: a layer that chose node_dedup saves; the same keys load into a
        #    placement="ep" layer and into a placement="auto" one, which restores the choice
        #    (no re-tuning) and runs node_dedup
        _inject(0.001, 0.010)
        layer = parity.make_layer(CASE, two_nodes, placement="auto", autotune_budget_s=None)
        x, _ = parity.make_batch(CASE, two_nodes.rank)
        layer.tune(x)
        with torch.no_grad():                   # weights the fresh layers do not have
            for p in layer.parameters():
                p.add_(0.25)
        checkpoint.save(ckpt_dir, layer, torch.optim.SGD(layer.parameters(), lr=0.1), 1)
        calls = []
        tuner._measure = lambda *a, **kw: calls.append(1) or 0.001
        loaded = {}
        for placement in ("ep", "node_dedup", "auto"):
            other = parity.make_layer(CASE, two_nodes, placement=placement,
                                      autotune_budget_s=None)
            checkpoint.load(ckpt_dir, other, torch.optim.SGD(other.parameters(), lr=0.1))
            y = other(x)
            loaded[placement] = {"params_equal": all(
                torch.equal(a, b) for a, b in zip(layer.parameters(), other.parameters())),
                "y": y.detach(), "strategy": other.strategy.name}
        out["checkpoint"] = dict(loaded, tuning_calls=len(calls), y_saved=layer(x).detach())
    finally:
        tuner._measure, tuner._time_step = real, real_step
    # 5. one node of 4 ranks: node_dedup is not a candidate, and the record says why
    one_node = Topology.from_env()
    seen = {}
    parity.run_rank(CASE, one_node, _tune_and_keep(seen), placement="auto",
                    autotune_budget_s=None)
    out["one_node"] = seen
    return out
