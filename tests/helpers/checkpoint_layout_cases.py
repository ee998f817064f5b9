"""Checkpoints across Parm layouts (importable by spawned ranks).

The model is dropless with no auxiliary loss, so its loss is the mean over the global batch
whatever the layout (capacity and the balancing loss would be per local batch): one process
and any (mp, ep, esp) layout train the same function, and a checkpoint taken on one layout must
resume on another exactly as the uninterrupted run continues. The global batch of a step has
``GLOBAL_BATCH`` sequences; data-parallel rank g of D takes rows [g B / D, (g + 1) B / D).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow import checkpoint
from moeflow.config import ModelConfig, TrainConfig
from moeflow.models import GPT
from moeflow.parallel.grad_sync import sync_gradients
from moeflow.parallel.replicas import prepare_model
from moeflow.topology import Topology
from moeflow.trainer import make_optimizer
from tests.helpers.gpt_tp_cases import locate

GLOBAL_BATCH = 4
CFG = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=24,
                  moe_every=2, seed=5, moe=dict(num_experts=4, d_expert=8, top_k=2,
                                                capacity_factor=None, aux_loss_coef=0.0,
                                                expert_bias=True, activation="swiglu"))
TRAIN = TrainConfig(steps=3, lr=0.01, grad_clip=0.0, warmup_steps=0)
SAVE_AT = 2
# (mp, ep, esp, esp_in_node): saved at the first, resumed at the second
SAVED, RESUMED = (2, 1, 2, True), (1, 2, 2, False)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(77 + step)
    w = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.seq_len + 1), generator=gen)
    return w[:, :-1], w[:, 1:]


def train_step(model: GPT, opt, topo: Topology, step: int) -> float:
    x, y = global_batch(step)
    rows = GLOBAL_BATCH // topo.dp_size
    x, y = (t[topo.dp_rank * rows:(topo.dp_rank + 1) * rows] for t in (x, y))
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    sync_gradients(model, topo)
    opt.step()
    mean = loss.detach().clone()          # the global batch's loss: the mean over ranks
    if topo.distributed:
        dist.all_reduce(mean)
        mean /= topo.world_size
    return float(mean)


def build(layout: tuple | None) -> tuple[GPT, torch.optim.Optimizer, Topology]:
    if layout is None:
        topo = Topology.single()
    else:
        mp, ep, esp, in_node = layout
        topo = Topology.from_env(ep_size=ep, local_size=2, mp_size=mp, esp_size=esp,
                                 esp_in_node=in_node)
    model = prepare_model(GPT(CFG, topo).double(), topo)
    return model, make_optimizer(model, TRAIN), topo


def worker(root: str) -> dict:
    """Train SAVE_AT steps at SAVED and save; resume at RESUMED, train the last step, save."""
    model, opt, topo = build(SAVED)
    losses = [train_step(model, opt, topo, s) for s in range(SAVE_AT)]
    checkpoint.save(f"{root}/saved", model, opt, SAVE_AT)
    dist.barrier()
    model, opt, topo = build(RESUMED)
    step = checkpoint.load(f"{root}/saved", model, opt)
    resumed = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses += [train_step(model, opt, topo, s) for s in range(step, TRAIN.steps)]
    checkpoint.save(f"{root}/resumed", model, opt, TRAIN.steps)
    return {"losses": losses, "loaded_step": step, "locate": locate(model),
            "resumed": resumed,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def reference() -> dict:
    """One process, uninterrupted: losses, parameters at SAVE_AT and at the end."""
    model, opt, topo = build(None)
    losses, at_save = [], {}
    for s in range(TRAIN.steps):
        if s == SAVE_AT:
            at_save = {n: p.detach().clone() for n, p in model.named_parameters()}
        losses.append(train_step(model, opt, topo, s))
    return {"losses": losses, "at_save": at_save, "model": model, "opt": opt,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
