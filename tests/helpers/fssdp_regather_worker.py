"""Rank side of tests/multirank/test_fssdp_regather.py: FSSDP GPTs with HECATE-RM and
Algorithm 1, trained with AdamW for a few steps with the re-gathering spAG on the critical path
(``overlap_regather=False``) and launched early on the lane (``True``), alone and together with
the spRS on the lane (``overlap_backward``). Per step: the logits, the loss, every parameter's
gradient (after ``sync_gradients``) and every parameter after the step."""

from __future__ import annotations

import torch

from moeflow import Topology, sync_gradients
from moeflow.strategies.fssdp.layer_experts import FSSDPExperts

LOCAL, STEPS = 2, 3
# (n_layers, moe_every): both blocks MoE (the next block's attention triggers the re-gather,
# the loss the last one's), and MoE blocks 1 and 3 with dense blocks between them
MODELS = {"all_moe": (2, 1), "dense_between": (4, 2)}
VARIANTS = {"off": dict(), "on": dict(overlap_regather=True),
            "off_sprs_lane": dict(overlap_backward=True),
            "on_sprs_lane": dict(overlap_backward=True, overlap_regather=True)}


def model(topo: Topology, n_layers: int, moe_every: int, **fssdp):
    from moeflow.config import ModelConfig
    from moeflow.models.gpt import GPT

    cfg = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=n_layers, n_heads=2, d_ff=32,
                      moe_every=moe_every, seed=5,
                      moe=dict(num_experts=8, d_expert=12, top_k=2, capacity_factor=None,
                               placement="fssdp",      # Algorithm 1, HECATE-RM
                               fssdp=dict(materialize="sparse", overlap_degree=2,
                                          memory_capacity=2, rematerialize=True, **fssdp)))
    return GPT(cfg, topo).double()


def train(topo: Topology, n_layers: int, moe_every: int, fssdp: dict) -> dict:
    gpt = model(topo, n_layers, moe_every, **fssdp)
    opt = torch.optim.AdamW(gpt.parameters(), lr=0.01)
    steps = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + topo.rank)
        idx = torch.randint(0, 32, (2, 8), generator=gen)
        tgt = torch.randint(0, 32, (2, 8), generator=gen)
        logits, loss = gpt(idx, tgt)
        (loss + gpt.aux_loss).backward()
        sync_gradients(gpt, topo)
        rec = {"logits": logits.detach(), "loss": loss.detach(),
               "grads": {n: p.grad.clone() for n, p in gpt.named_parameters()
                         if p.grad is not None}}
        opt.step()
        opt.zero_grad()
        rec["params"] = {n: p.detach().clone() for n, p in gpt.named_parameters()}
        steps.append(rec)
    experts = [m.experts for m in gpt.moe_layers() if isinstance(m.experts, FSSDPExperts)]
    return {"steps": steps,
            "regather_on_lane": [e.regather_on_lane for e in experts],
            "replicated": [sum(len(h) > 1 for h in e.last_placement.holders) for e in experts],
            "spag_backward": [e.bytes.get("spag_backward") for e in experts]}


def worker(models: list[str]) -> dict:
    topo = Topology.from_env(local_size=LOCAL)
    return {(m, v): train(topo, *MODELS[m], VARIANTS[v]) for m in models for v in VARIANTS}
