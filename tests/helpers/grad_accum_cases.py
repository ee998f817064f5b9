"""Gradient accumulation against one step on the N-times batch, float64, on 2 gloo ranks
(importable by spawned ranks; run by tests/multirank/test_grad_accum.py).

Each rank builds the GPT for a layout (plain EP, Parm's ESP expert shards, HECATE's FSSDP) and
computes the synchronised gradients three ways from the same start:

* ``accum``: ``train.accumulate_gradients`` over N micro-batches of B sequences, then one
  ``sync_gradients`` (what ``moeflow train --grad-accum N`` runs);
* ``big``: one micro-batch of the N*B sequences (``--batch-size N*B``), then ``sync_gradients``;
* ``ref``: the documented meaning of an accumulated step: the cross-entropy of the N*B batch in
  one forward, plus ``aux_i / N`` of each micro-batch in its own forward (the balancing loss
  is a per-micro-batch quantity).

Routing is dropless, so the experts see every token in every split. With
``aux_loss_coef = 0`` the accumulated step must equal the big one; with the balancing loss on
it must equal ``ref`` (and differs from ``big``). The all-reduces are counted: those of the
gradient synchronisation must not grow with N.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from moeflow.config import ModelConfig
from moeflow.models import GPT
from moeflow.parallel.grad_sync import sync_gradients
from moeflow.parallel.replicas import check_replicas, prepare_model
from moeflow.topology import Topology
from moeflow.trainer import accumulate_gradients

N, B = 3, 2
CFG = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=24,
                  moe_every=1, seed=5, moe=dict(num_experts=4, d_expert=8, top_k=2,
                                                capacity_factor=None, aux_loss_coef=0.0))
LAYOUTS = {                       # name: (MoEConfig overrides, Topology.from_env kwargs)
    "ep": ({}, dict(ep_size=2)),
    "parm_esp": ({}, dict(ep_size=1, esp_size=2)),
    "fssdp": ({"placement": "fssdp"}, dict(ep_size=2)),
    "ep_aux": ({"aux_loss_coef": 0.05}, dict(ep_size=2)),
}


def big_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    w = torch.randint(0, CFG.vocab_size, (N * B, CFG.seq_len + 1), generator=gen)
    return w[:, :-1], w[:, 1:]


class _CountAllReduce:
    """Counts ``dist.all_reduce`` calls (every caller looks it up on ``dist`` at call time)."""

    def __init__(self):
        self.n = 0

    def __enter__(self):
        self.orig = dist.all_reduce

        def counting(*a, **k):
            self.n += 1
            return self.orig(*a, **k)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.orig
        return False


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def run_layout(name: str) -> dict:
    over, topo_kw = LAYOUTS[name]
    topo = Topology.from_env(**topo_kw)
    cfg = CFG.replace(moe=over)
    model = prepare_model(GPT(cfg, topo).double(), topo)
    check_replicas(model, topo)       # the first sync's one-off check, outside the counts
    x, y = big_batch(topo.dp_rank)
    micro = list(zip(x.split(B), y.split(B)))
    out = {}
    for kind, batches in (("accum", micro), ("big", [(x, y)])):
        model.zero_grad(set_to_none=True)
        with _CountAllReduce() as fwd_bwd:
            stats = accumulate_gradients(model, batches)
        with _CountAllReduce() as sync:
            sync_gradients(model, topo)
        out[kind] = {"grads": _grads(model), "stats": stats.tolist(),
                     "allreduce_fwd_bwd": fwd_bwd.n, "allreduce_sync": sync.n}
    model.zero_grad(set_to_none=True)
    _, ce = model(x, y)
    ce.backward()
    for xm, ym in micro:
        model(xm, ym)
        (model.aux_loss / N).backward()
    sync_gradients(model, topo)
    out["ref"] = {"grads": _grads(model)}
    return out


def worker(layouts: list[str]) -> dict:
    torch.manual_seed(0)
    return {name: run_layout(name) for name in layouts}


def trainer_steps(out_dir: str) -> dict:
    """Two steps of ``moeflow train``'s Trainer (fp32, DeepSeek-V3 router with the
    aux-loss-free bias update, dropless) with ``grad_accum=3, batch_size=2`` and with
    ``batch_size=6``: the router biases, parameters and metrics records after each."""
    from moeflow.config import TrainConfig
    from moeflow.trainer import Trainer

    mcfg = ModelConfig(n_layers=2, seq_len=16, d_model=32, n_heads=2, d_ff=64,
                       moe=dict(num_experts=4, d_expert=32, capacity_factor=None,
                                aux_loss_coef=0.0, router="deepseek_v3",
                                router_options={"bias_update_speed": 0.01}))
    out = {}
    for name, kw in (("accum", dict(batch_size=2, grad_accum=3)), ("big", dict(batch_size=6))):
        topo = Topology.from_env(ep_size=2)
        tcfg = TrainConfig(steps=2, log_every=1, eval_every=100, eval_batches=1,
                           warmup_steps=0, grad_clip=0.0, **kw)
        trainer = Trainer(mcfg, tcfg, f"{out_dir}/{name}", topo, progress=False)
        res = trainer.run()
        out[name] = {
            "bias": [m.router.e_score_correction_bias.clone() for m in trainer.model.moe_layers()],
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "history": [r for r in res["history"] if "loss" in r]}
    return out


def trainer_worker(out_dir: str) -> dict:
    torch.manual_seed(0)
    return trainer_steps(out_dir)
