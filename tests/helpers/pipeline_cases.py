"""Pipeline parallelism against the unpipelined step, float64 (importable by spawned ranks; run
by tests/multirank/test_pipeline.py).

The same function on both sides: PP 2 x EP 2 on 4 ranks against PP 1 x EP 2 on 2 ranks. Both
have 2 data-parallel positions with the same batches (drawn for data-parallel rank 0 and 1),
each MoE layer's experts split over an EP group of 2 in the same way, and N micro-batches of
B sequences per step; so the losses, the synchronised gradients of every parameter (each
expert shard on its EP rank), the global gradient norm and the validation loss (N batches
through the pipeline's forward-only schedule) must agree to round-off. The MoE
layers' balancing loss is on (its gradient crosses the stages) and routing is dropless.
"""

from __future__ import annotations

import torch

from moeflow.config import ModelConfig, TrainConfig
from moeflow.models import GPT
from moeflow.parallel.grad_clip import global_grad_norm
from moeflow.parallel.grad_sync import sync_gradients
from moeflow.topology import Topology
from moeflow.trainer import accumulate_gradients

N, B = 4, 2
CFG = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=4, n_heads=4, d_ff=24,
                  moe_every=2, seed=5, moe=dict(num_experts=4, d_expert=8, top_k=2,
                                                capacity_factor=None, aux_loss_coef=0.05))


def batch(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dp_rank)
    w = torch.randint(0, CFG.vocab_size, (N * B, CFG.seq_len + 1), generator=gen)
    return w[:, :-1], w[:, 1:]


def eval_batches(dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """N validation batches of B sequences (each one micro-batch of the pipeline's)."""
    x, y = batch(50 + dp_rank)
    return list(zip(x.split(B), y.split(B)))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def reference_worker() -> dict:
    """PP 1 x EP 2 on 2 ranks: ``moeflow train``'s accumulation, synchronisation and norm."""
    torch.manual_seed(0)
    topo = Topology.from_env(ep_size=2)
    model = GPT(CFG, topo).double()
    model.eval()
    with torch.no_grad():             # moeflow.trainer.evaluate's sum over the batches
        val = sum(float(model(xv, yv)[1]) for xv, yv in eval_batches(topo.dp_rank))
    model.train()
    x, y = batch(topo.dp_rank)
    stats = accumulate_gradients(model, list(zip(x.split(B), y.split(B))))
    sync_gradients(model, topo)
    return {"dp_rank": topo.dp_rank, "grads": _grads(model), "stats": stats.tolist(),
            "norm": float(global_grad_norm(model, topo)), "val": val}


def pipeline_worker(schedules: list[str]) -> dict:
    """PP 2 x EP 2 on 4 ranks, one step of each schedule from the same start (``S:off``:
    schedule S with ``pp_overlap="off"``, ``S:on`` with it on)."""
    from moeflow.pipeline_parallel import PipelineRunner, build_pipeline_mesh

    torch.manual_seed(0)
    out = {}
    meshes = {}
    for name in schedules:
        sched, _, overlap = name.partition(":")
        v_shape = sched in ("zbv", "dualpipev")
        if v_shape not in meshes:
            meshes[v_shape] = build_pipeline_mesh(2, 2, tied_across_ranks=not v_shape)
        tcfg = TrainConfig(pp=2, pp_schedule=sched, grad_accum=N, batch_size=B, ep_size=2,
                           eval_batches=N, pp_overlap=overlap or "auto")
        runner = PipelineRunner(CFG, tcfg, torch.device("cpu"), param_dtype=torch.float64,
                                mesh=meshes[v_shape])
        val = float(runner.evaluate_batches(eval_batches(runner.dp_rank)))
        x, y = batch(runner.dp_rank)
        stats = runner.forward_backward(x, y)
        norm = runner.sync_and_clip(0.0)
        out[name] = {"dp_rank": runner.dp_rank, "pp_rank": runner.mesh.pp_rank,
                     "grads": _grads(runner.model), "stats": stats.tolist(),
                     "norm": float(norm), "val": val, "a2a": runner.take_a2a_times()}
    return out
