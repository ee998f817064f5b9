"""FSDP2 on the dense part (``moeflow.parallel.fsdp``) against one unsharded process, float64,
on 4 gloo ranks, and checkpoints across the two dense layouts (importable by spawned ranks;
run by tests/multirank/test_fsdp.py).

The model is dropless with no auxiliary loss, so any layout trains the same function as one
process on the global batch (see ``checkpoint_layout_cases``). Each layout runs STEPS AdamW
steps with global-norm clipping (small enough to clip) in three stretches, each on a freshly
built model that loads the previous stretch's checkpoint:

* ``A``: FSDP2 on, steps [0, 2), saved (sharded dense tensors);
* ``B``: FSDP2 off (replicated), loads ``A`` (on -> off), step 2, saved;
* ``C``: FSDP2 on again, loads ``B`` (off -> on), step 3, saved.

The ranks report every step's loss, the dense parameters (whole, ``full_tensor``; with MP, an
MP shard's whole block, and its ``TPShard``) after ``A`` and what FSDP2 made of the model; the test compares them with the uninterrupted one-process
run and loads ``C`` into one process to compare every parameter and AdamW moment.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from moeflow import checkpoint
from moeflow.config import ModelConfig, TrainConfig
from moeflow.models import GPT
from moeflow.parallel.fsdp import is_fsdp_param, shard_dense
from moeflow.parallel.grad_clip import clip_gradients
from moeflow.parallel.grad_sync import is_expert_param, sync_gradients
from moeflow.parallel.replicas import prepare_model
from moeflow.parallel.tensor_parallel import tp_shard
from moeflow.topology import Topology
from moeflow.trainer import make_optimizer

WORLD = 4
GLOBAL_BATCH = 8
CFG = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=24,
                  moe_every=2, seed=5, moe=dict(num_experts=4, d_expert=8, top_k=2,
                                                capacity_factor=None, aux_loss_coef=0.0,
                                                expert_bias=True, activation="swiglu"))
TRAIN = TrainConfig(steps=4, lr=0.01, grad_clip=0.05, warmup_steps=0)
STRETCHES = (("A", True, 0, 2), ("B", False, 2, 3), ("C", True, 3, 4))
LAYOUTS = {                       # name: (MoEConfig overrides, Topology.from_env kwargs)
    "ep2": ({}, dict(ep_size=2)),                 # experts replicated over 2 EP groups
    "ep4": ({}, dict(ep_size=4)),
    "fssdp": ({"placement": "fssdp"}, dict(ep_size=4)),     # HECATE FSSDP, a2a default
    "esp2": ({}, dict(ep_size=2, esp_size=2)),   # Parm's expert sharding (its dense mesh)
    "ep2_recompute": ({}, dict(ep_size=2)),      # every block under torch.utils.checkpoint
    # Parm's tensor parallelism (MP 2: each dense weight an MP shard, FSDP2 over the DP pair
    # of ranks with the same MP rank): S1 gates 1/N_MP of the tokens on each MP rank, so the
    # router's MP ranks hold different partial gradients (the MP all-reduce after FSDP2's DP
    # reduction); the baseline schedule; expert sharding (ESP 2) under MP
    "mp2_s1": ({"parallel_schedule": "s1"}, dict(ep_size=2, mp_size=2)),
    "mp2": ({}, dict(ep_size=2, mp_size=2)),
    "mp2_esp2": ({}, dict(ep_size=1, esp_size=2, mp_size=2)),
}


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(31 + step)
    w = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.seq_len + 1), generator=gen)
    return w[:, :-1], w[:, 1:]


def train_step(model: GPT, opt, topo: Topology, step: int) -> float:
    """One AdamW step on this rank's rows of the global batch; the global loss."""
    x, y = global_batch(step)
    rows = GLOBAL_BATCH // topo.dp_size
    x, y = (t[topo.dp_rank * rows:(topo.dp_rank + 1) * rows] for t in (x, y))
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    sync_gradients(model, topo)
    clip_gradients(model, topo, TRAIN.grad_clip)
    opt.step()
    mean = loss.detach().clone()
    if topo.distributed:
        dist.all_reduce(mean)
        mean /= topo.world_size
    return float(mean)


def build(layout: str | None, fsdp: bool) -> tuple[GPT, torch.optim.Optimizer, Topology]:
    over, topo_kw = LAYOUTS[layout] if layout else ({}, None)
    topo = Topology.from_env(**topo_kw) if topo_kw else Topology.single()
    model = prepare_model(GPT(CFG.replace(moe=over), topo).double(), topo)
    model.checkpoint_blocks = bool(layout and layout.endswith("_recompute"))
    if fsdp:
        shard_dense(model, topo)
    return model, make_optimizer(model, TRAIN), topo


def whole(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if is_fsdp_param(p) else p).detach().clone()


def worker(root: str, layout: str) -> dict:
    losses, out = [], {}
    for name, fsdp, first, last in STRETCHES:
        model, opt, topo = build(layout, fsdp)
        if first:
            loaded = checkpoint.load(f"{root}/{layout}-{prev}", model, opt)
            assert loaded == first, (loaded, first)
        losses += [train_step(model, opt, topo, s) for s in range(first, last)]
        checkpoint.save(f"{root}/{layout}-{name}", model, opt, last)
        dist.barrier()
        if name == "A":
            out["dense_after_A"] = {n: whole(p) for n, p in model.named_parameters()
                                    if not is_expert_param(p)}
            out["sharded"] = sorted(n for n, p in model.named_parameters()
                                    if is_fsdp_param(p))
            out["expert_dtensors"] = [n for n, p in model.named_parameters()
                                      if is_expert_param(p) and is_fsdp_param(p)]
            out["local_numel"] = {n: p.to_local().numel() for n, p in model.named_parameters()
                                  if is_fsdp_param(p)}
            # MP shards (whole over DP: this MP rank's block of the global weight)
            out["tp_specs"] = {n: tp_shard(p) for n, p in model.named_parameters()
                               if tp_shard(p) is not None}
        prev = name
    out["losses"] = losses
    return out


def reference() -> dict:
    """One process, uninterrupted: every loss, the parameters after A and at the end, and
    the optimizer."""
    model, opt, topo = build(None, False)
    losses, after_a = [], {}
    for s in range(TRAIN.steps):
        losses.append(train_step(model, opt, topo, s))
        if s + 1 == STRETCHES[0][3]:
            after_a = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "after_A": after_a, "model": model, "opt": opt}
