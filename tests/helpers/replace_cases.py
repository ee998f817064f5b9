"""Rank side and reference of tests/multirank/test_replace.py: the SmartMoE-style re-placement
(``fssdp={"replace_every": K}``, moeflow/strategies/fssdp/replace.py) against one process in float64.

Each rank trains one MoE layer for ``STEPS`` AdamW steps on its own batch (the parity cases of
tests/helpers/parity.py, a fresh noise per step) and calls ``maybe_replace`` after every
optimizer step, so with ``EVERY = 2`` the experts are re-placed after steps 2 and 4 from the
load window; the steps after a re-placement run on the new owners with the moved parameters
and AdamW moments. Expert tensors are keyed by global id, wherever the expert lives.
"""

from __future__ import annotations

import torch

from moeflow import Topology, sync_gradients
from moeflow.strategies.fssdp.replace import maybe_replace
from tests.helpers import parity
from tests.helpers.fssdp_layer_worker import batch, dense, expert_tensors
from tests.helpers.fssdp_layer_worker import reference as fssdp_reference

WORLD, LOCAL, STEPS, EVERY, LR = 4, 2, 5, 2, 0.02
CASES = ["hot_expert_capacity", "capacity_k2"]


def adam_state(layer, opt) -> dict:
    """``{(expert, name, key): tensor}``: AdamW's moments of the experts this rank stores."""
    ex = layer.experts
    out = {}
    if hasattr(ex, "slots"):                     # FSSDP: rows of the slot tensor's state
        st = opt.state[ex.slots]
        for key in ("exp_avg", "exp_avg_sq"):
            for e, i in ex.slot_index.items():
                for n, v in ex._views(st[key][i:i + 1]).items():
                    out[e, n, key] = v[0].clone()
        return out
    for n, p in ex.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            for i in range(ex.num_local):
                out[ex.first_expert + i, n, key] = opt.state[p][key][i].clone()
    return out


def run(name: str, topo: Topology) -> list[dict]:
    layer = parity.make_layer(name, topo, placement="fssdp",
                              fssdp=dict(replace_every=EVERY, window=2))
    opt = torch.optim.AdamW(layer.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        x, g = batch(name, topo.rank, step)
        x.requires_grad_()
        y = layer(x, **parity._spec(name).get("call", {}))
        parity.local_loss(y, g, layer).backward()
        sync_gradients(layer, topo)
        rec = {"y": y.detach(), "x_grad": x.grad, "grads": expert_tensors(layer, True),
               "dense_grads": dense(layer, True)}
        opt.step()
        opt.zero_grad()
        replaced = maybe_replace(layer, opt, step + 1)
        rec.update(params=expert_tensors(layer, False), dense_params=dense(layer, False),
                   state=adam_state(layer, opt), replaced=replaced,
                   owners=list(layer.experts.owners.owners),
                   window=layer.experts.window.estimate().tolist(), states=len(opt.state))
        steps.append(rec)
    return steps


def gpt_run(topo: Topology) -> dict:
    """A 2-layer MoE GPT (one shared slot tensor) under EP and under ``replace_every=2`` for
    4 AdamW steps, re-placing after steps 2 and 4 (``maybe_replace``, as ``moeflow train``)."""
    from tests.helpers.fssdp_layer_worker import all_experts, small_gpt, train_steps

    out = {}
    for label, extra in (("ep", {}), ("replace", dict(placement="fssdp",
                                                      fssdp=dict(replace_every=2)))):
        model = small_gpt(topo, **extra)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        losses, owners = [], []
        for step in range(4):
            losses += train_steps(model, opt, topo, range(step, step + 1))
            if maybe_replace(model, opt, step + 1):
                owners.append([list(m.experts.owners.owners) for m in model.moe_layers()])
        out[label] = {"losses": losses, "owners": owners, "experts": all_experts(model)}
    return out


def worker() -> dict:
    topo = Topology.from_env(local_size=LOCAL)
    out = {c: run(c, topo) for c in CASES}
    out["gpt"] = gpt_run(topo)
    return out


def reference(name: str) -> list[dict]:
    return fssdp_reference(name, STEPS, adam_state)
