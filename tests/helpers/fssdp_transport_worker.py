"""Rank side of tests/multirank/test_fssdp_transport.py: one FSSDP layer per spAG / spRS
transport (``MoEConfig.fssdp.transport``) and with the spRS on the lane
(``overlap_backward``), the same batches and replicated placements, with the early spAG
(``layer.prefetch()``) and re-materialization, over two AdamW steps; and a 2-layer GPT with and
without ``overlap_backward`` (the second layer's spRS drained by the first layer's backward)."""

from __future__ import annotations

import torch

from moeflow import Topology, sync_gradients
from tests.helpers import fssdp_layer_worker as w
from tests.helpers import parity

CASE, STEPS = "hot_expert_dropless", 2
VARIANTS = {"p2p": dict(transport="p2p"), "broadcast": dict(transport="broadcast"),
            "auto": dict(transport="auto"),
            "p2p_overlap": dict(transport="p2p", overlap_backward=True),
            "broadcast_overlap": dict(transport="broadcast", overlap_backward=True)}


def run(topo: Topology, variant: str) -> list[dict]:
    layer = parity.make_layer(CASE, topo, placement="fssdp",
                              fssdp=dict(materialize="manual", rematerialize=True,
                                         **VARIANTS[variant]))
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
        rec["sprs_on_lane"] = layer.experts.sprs_on_lane
        steps.append(rec)
    return steps


def gpt(topo: Topology, overlap: bool, steps: int = 2) -> dict:
    """Losses and final parameters of a 2-layer FSSDP GPT (random P', early spAG, RM)."""
    from moeflow.config import ModelConfig
    from moeflow.models.gpt import GPT

    cfg = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                      moe_every=1, seed=5,
                      moe=dict(num_experts=8, d_expert=12, top_k=2, capacity_factor=None,
                               placement="fssdp",
                               fssdp=dict(materialize="manual", rematerialize=True,
                                          overlap_backward=overlap)))
    model = GPT(cfg, topo).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for step in range(steps):
        for i, layer in enumerate(model.moe_layers()):
            layer.experts.set_holders(w.RANDOM[(step + i) % len(w.RANDOM)])
        gen = torch.Generator().manual_seed(100 * step + topo.rank)
        idx = torch.randint(0, 32, (2, 8), generator=gen)
        tgt = torch.randint(0, 32, (2, 8), generator=gen)
        _, loss = model(idx, tgt)
        (loss + model.aux_loss).backward()
        sync_gradients(model, topo)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone()
                                         for n, p in model.named_parameters()},
            "sprs_on_lane": [m.experts.sprs_on_lane for m in model.moe_layers()]}


def worker() -> dict:
    topo = Topology.from_env(local_size=w.LOCAL)
    out = {v: run(topo, v) for v in VARIANTS}
    out["gpt"] = {o: gpt(topo, o) for o in (False, True)}
    return out
