"""A full GPT training step with Parm's MP (tensor-parallel attention and dense MLP) + EP / ESP
experts against one process, in float64 (importable by spawned ranks).

Each rank of a 4-rank job (2 nodes x 2) builds the GPT for its layout, trains two AdamW steps
with gradient clipping on the batch of its data-parallel rank (the ranks of an MP group share
it), and reports its losses, its synchronised gradients of the first step (before clipping,
whose scale comes from a float32 norm) and
its parameters after both. The reference is one process holding every weight whole: its loss is
the mean over the data-parallel groups of each group's (cross-entropy + aux) loss, with
capacity computed per group's batch, exactly the loss the distributed job minimises.
"""

from __future__ import annotations


import torch

from moeflow.config import ModelConfig, TrainConfig
from moeflow.experts.ffn import ExpertFFN, HIDDEN_DIM
from moeflow.models import GPT
from moeflow.parallel.grad_clip import clip_gradients
from moeflow.parallel.grad_sync import sync_gradients
from moeflow.parallel.replicas import ReplicaMismatchError, check_replicas, prepare_model
from moeflow.parallel.tensor_parallel import shard_of, tp_shard
from moeflow.topology import Topology
from moeflow.trainer import make_optimizer

WORLD = 4
LAYOUTS = {                        # (mp, ep, esp, esp_in_node)
    "mp2_ep2": (2, 2, 1, True),
    "mp2_esp2": (2, 1, 2, True),
    "mp4": (4, 1, 1, True),
    "mp2_ep2_s2": (2, 2, 1, True),
    "mp2_esp2_s1": (2, 1, 2, True),
}
# Parm's S1 / S2 in the tensor-parallel GPT (the MoE input replicated over the MP group by the
# row-parallel layers before it). S2 gates every token, so it drops what one process drops; S1
# gates 1/N_MP of them (capacity per MP part, aux loss the mean of the parts'), so its layout
# runs dropless without an auxiliary loss, where the function does not depend on the split.
SCHEDULES = {"mp2_ep2_s2": dict(parallel_schedule="s2"),
             "mp2_esp2_s1": dict(parallel_schedule="s1", capacity_factor=None,
                                 aux_loss_coef=0.0)}
CFG = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=24,
                  moe_every=2, seed=3, moe=dict(num_experts=4, d_expert=8, top_k=2,
                                                capacity_factor=1.0, expert_bias=True))
TRAIN = TrainConfig(steps=2, batch_size=3, lr=0.01, grad_clip=0.5, warmup_steps=0)
STEPS = 2


def batch(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    w = torch.randint(0, CFG.vocab_size, (TRAIN.batch_size, CFG.seq_len + 1), generator=gen)
    return w[:, :-1], w[:, 1:]


def topology(layout: str) -> Topology:
    mp, ep, esp, in_node = LAYOUTS[layout]
    return Topology.from_env(ep_size=ep, local_size=2, mp_size=mp, esp_size=esp,
                             esp_in_node=in_node)


def _step(model: GPT, opt, topo: Topology, step: int) -> tuple[float, float, dict]:
    x, y = batch(topo.dp_rank, step)
    _, ce = model(x, y)
    loss = ce + model.aux_loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    sync_gradients(model, topo)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = clip_gradients(model, topo, TRAIN.grad_clip)      # a float32 norm (grad_clip.py)
    opt.step()
    return float(loss.detach()), float(norm), grads


def config(layout: str) -> ModelConfig:
    return CFG.replace(moe=SCHEDULES.get(layout, {}))


def run_layout(layout: str) -> dict:
    topo = topology(layout)
    model = prepare_model(GPT(config(layout), topo).double(), topo)
    opt = make_optimizer(model, TRAIN)
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        loss, norm, step_grads = _step(model, opt, topo, step)
        losses.append(loss)
        norms.append(norm)
        if step == 0:
            grads = step_grads
    out = {"loss": losses, "norm": norms, "grads": grads,
           "params": {n: p.detach().clone() for n, p in model.named_parameters()},
           "locate": locate(model)}
    # a tensor-parallel shard that differs inside its data-parallel group is caught
    with torch.no_grad():
        if topo.rank == topo.mp_size:          # MP rank 0 of the second data-parallel group
            model.blocks[0].attn.qkv.weight.add_(1.0)
    try:
        check_replicas(model, topo)
        out["mismatch"] = None
    except ReplicaMismatchError as e:
        out["mismatch"] = str(e)
    return out


def locate(model: GPT) -> dict[str, tuple]:
    """How each parameter of this rank maps into the global one: ("tp", spec),
    ("expert", first, num_local, (s, n)) or ("whole",)."""
    where = {}
    experts = {id(m): m for m in model.modules() if isinstance(m, ExpertFFN)}
    owner = {id(p): m for m in experts.values() for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        if tp_shard(p) is not None:
            where[name] = ("tp", tp_shard(p))
        elif id(p) in owner:
            m = owner[id(p)]
            where[name] = ("expert", m.first_expert, m.num_local, m.shard)
        else:
            where[name] = ("whole",)
    return where


def trainer_batches(out_dir: str) -> dict:
    """One step of ``moeflow train``'s Trainer at MP=2, ESP=2: the batches each rank drew and
    its loss (the ranks of an MP group must share both)."""
    import torch.distributed as dist

    from moeflow.trainer import Trainer

    topo = topology("mp2_esp2")
    mcfg = ModelConfig(n_layers=2, seq_len=16, d_model=32, n_heads=2, d_ff=64,
                       moe=dict(num_experts=4, d_expert=32))
    trainer = Trainer(mcfg, TrainConfig(steps=1, batch_size=2), out_dir, topo, progress=False)
    seen, draw = [], trainer.corpus.batch

    def recording(*args):
        seen.append(args)
        return draw(*args)

    trainer.corpus.batch = recording
    loss = trainer.train_step()[0]
    x = draw(*seen[0])[0]
    everyone = [torch.zeros_like(x) for _ in range(topo.world_size)]
    dist.all_gather(everyone, x)
    return {"seen": seen, "loss": float(loss), "dp_rank": topo.dp_rank,
            "batches": everyone}


def worker(layouts: list[str], out_dir: str) -> dict:
    torch.manual_seed(0)
    out = {layout: run_layout(layout) for layout in layouts}
    out["trainer"] = trainer_batches(out_dir)
    return out


def reference(mp: int, cfg: ModelConfig = CFG) -> dict:
    """One process: every weight whole, the loss averaged over the data-parallel groups."""
    model = GPT(cfg).double()
    opt = make_optimizer(model, TRAIN)
    dp = WORLD // mp
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        per_group = []
        for g in range(dp):
            x, y = batch(g, step)
            _, ce = model(x, y)
            per_group.append(ce + model.aux_loss)
        total = torch.stack(per_group).mean()
        total.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN.grad_clip)))
        opt.step()
        losses.append([float(v.detach()) for v in per_group])
    return {"loss": losses, "norm": norms, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def global_slice(full: torch.Tensor, where: tuple, name: str) -> torch.Tensor:
    """The part of the whole tensor ``full`` that a rank holds (see :func:`locate`)."""
    if where[0] == "tp":
        return shard_of(full, where[1])
    if where[0] == "expert":
        _, first, n, (s, shards) = where
        full = full[first:first + n]
        dim = HIDDEN_DIM.get(name.rsplit(".", 1)[1])
        if shards > 1 and dim is not None:
            width = full.shape[1 + dim] // shards
            full = full.narrow(1 + dim, s * width, width)
        return full
    return full
