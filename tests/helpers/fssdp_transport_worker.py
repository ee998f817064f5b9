"""Rank side of tests/multirank/test_fssdp_transport.py: one FSSDP layer per spAG / spRS
transport (``MoEConfig.fssdp.transport``), the same batches and replicated placements, with
the early spAG (``layer.prefetch()``) and re-materialization, over two AdamW steps."""

from __future__ import annotations

import torch

from moeflow import Topology, sync_gradients
from tests.helpers import fssdp_layer_worker as w
from tests.helpers import parity

CASE, STEPS = "hot_expert_dropless", 2
TRANSPORTS = ("p2p", "broadcast", "auto")


def run(topo: Topology, transport: str) -> list[dict]:
    layer = parity.make_layer(CASE, topo, placement="fssdp",
                              fssdp=dict(materialize="manual", rematerialize=True,
                                         transport=transport))
    opt = torch.optim.AdamW(layer.parameters(), lr=w.LR)
    steps = []
    for step in range(STEPS):
        layer.experts.set_holders(w.SKEWED[step])
        x, g = w.batch(CASE, topo.rank, step)
        x.requires_grad_()
        layer.prefetch()                     # the early spAG, on the layer's lane
        y = layer(x)
        parity.local_loss(y, g, layer).backward()
        sync_gradients(layer, topo)
        rec = {"y": y.detach(), "x_grad": x.grad, "grads": w.expert_tensors(layer, True),
               "stats": layer.stats}
        opt.step()
        opt.zero_grad()
        rec["params"] = w.expert_tensors(layer, False)
        steps.append(rec)
    return steps


def worker() -> dict:
    topo = Topology.from_env(local_size=w.LOCAL)
    return {t: run(topo, t) for t in TRANSPORTS}
