"""Rank worker for tests/multirank/test_node_dedup_hooks.py (importable by spawned ranks):
the node-deduplicated exchange at ``pipeline_degree`` 2 under saved-tensor hooks
(``torch.utils.checkpoint`` without reentrance, ``torch.autograd.graph.save_on_cpu``) with an
empty chunk on rank 0 only (ScheMoE section 4's chunks; docs/design.md, "One collective order
per rank"), and the padded mode's gather of the ranks' token counts and capacities under
``MoEConfig.equal_rank_tokens`` (GShard section 2.2's capacity slots)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

import moeflow.dispatch.plan as plan_mod
from moeflow import Topology
from moeflow.strategies.node_dedup import backward as backward_mod
from tests.helpers import parity

CASES = {"dropless": ("dropless_k2", {}),
         "padded": ("capacity_k2", {"capacity_padding": "pad"})}
HOOKS = ("none", "save_on_cpu", "checkpoint")
SIZES = (6, 6, 4, 6, 4)            # padded: tokens of the successive forwards, on both ranks


def _step(layer, x: torch.Tensor, hooks: str):
    x = x.detach().clone().requires_grad_()
    if hooks == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            y = layer(x)
    elif hooks == "checkpoint":
        y = checkpoint(layer, x, use_reentrant=False)
    else:
        y = layer(x)
    (y * y).sum().backward()
    grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    layer.zero_grad(set_to_none=True)
    return [y.detach(), x.grad] + grads


def hooks_worker() -> dict:
    """``{(case, hooks): (tensors, scheduled backwards)}``: rank 0 calls the layer with one
    token (its first of 2 chunks is empty), rank 1 with its whole batch."""
    topo = Topology.from_env(local_size=1)            # 2 nodes x 1
    calls = []
    real = backward_mod._ScheduledDedup.backward

    def counted(ctx, grad):
        calls.append(1)
        return real(ctx, grad)

    backward_mod._ScheduledDedup.backward = staticmethod(counted)
    out = {}
    try:
        for name, (case, kw) in CASES.items():
            layer = parity.make_layer(case, topo, placement="node_dedup", pipeline_degree=2,
                                      schedule="optsche", **kw)
            x, _ = parity.make_batch(case, topo.rank)
            x = x[:1] if topo.rank == 0 else x
            for hooks in HOOKS:
                calls.clear()
                got = _step(layer, x, hooks)
                out[name, hooks] = (got, len(calls))
    finally:
        backward_mod._ScheduledDedup.backward = real
    return out


def padded_gather_worker(equal: bool) -> dict:
    """Host gathers of the padded mode's ``[T_q, C_q]`` over ``SIZES``, and the outputs."""
    topo = Topology.from_env(local_size=1)
    layer = parity.make_layer("capacity_k2", topo, placement="node_dedup", capacity_padding="pad",
                              equal_rank_tokens=equal)
    real, calls = plan_mod.gather_host_ints, []      # padded_counts gathers through it

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    plan_mod.gather_host_ints = counted
    ys = []
    try:
        for i, t in enumerate(SIZES):
            x, _ = parity.make_batch("capacity_k2", topo.rank)
            ys += _step(layer, x[:t] * (1 + i), "none")
    finally:
        plan_mod.gather_host_ints = real
    return {"gathers": len(calls), "tensors": ys}


def broken_promise_worker() -> str:
    """Padded node_dedup under ``equal_rank_tokens`` with 6 tokens on rank 0, 4 on rank 1."""
    topo = Topology.from_env(local_size=1)
    layer = parity.make_layer("capacity_k2", topo, placement="node_dedup", capacity_padding="pad",
                              equal_rank_tokens=True)
    x, _ = parity.make_batch("capacity_k2", topo.rank)
    try:
        layer(x[:6 - 2 * topo.rank])
    except Exception as e:                                     # noqa: BLE001 (reported)
        return f"{type(e).__name__}: {e}"
    return "no error"
