"""Gradients across pipeline stages: the tied embedding's two copies summed, the global norm
over every stage (each parameter once), and the clipping with it.

The token embedding is used by the first stage (lookup) and by the last (the tied head). On
one rank (V schedules) the two stages share the parameter and autograd adds both uses; on two
ranks each holds a copy, and the copies' gradients are summed over the tie group (Megatron-LM,
Shoeybi et al. 2019 Section 3, its embedding all-reduce), so the copies stay equal after the
optimizer step. The global norm is the stage groups' norms (:func:`global_grad_norm`, each
expert once) summed in squares over the pipeline ranks, the head's copy left out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.parallel.grad_clip import global_grad_norm
from moeflow.pipeline_parallel.mesh import PipelineMesh


def sum_tied_embedding(model, mesh: PipelineMesh) -> None:
    """Sum the gradients of the embedding's copies on the first and last pipeline rank (no-op
    on the other ranks, and where both stages are on one rank)."""
    if mesh.tie_group is None or not hasattr(model, "tok"):
        return
    grad = model.tok.weight.grad
    if grad is None:
        grad = model.tok.weight.grad = torch.zeros_like(model.tok.weight)
    dist.all_reduce(grad, group=mesh.tie_group)


class _Params:
    """The ``parameters()`` of a module but one (what :func:`global_grad_norm` reads)."""

    def __init__(self, model, leave_out):
        self._params = [p for p in model.parameters() if p is not leave_out]

    def parameters(self):
        return iter(self._params)


def pipeline_grad_norm(model, mesh: PipelineMesh) -> torch.Tensor:
    """The L2 norm of the whole model's gradients (every stage, each expert and the tied
    embedding once): the same 0-dim float32 tensor on every rank."""
    holds_copy = (mesh.tie_group is not None and hasattr(model, "tok")
                  and not hasattr(model, "pos"))     # the last stage's copy of the embedding
    params = _Params(model, model.tok.weight if holds_copy else None)
    sq = global_grad_norm(params, mesh.stage).square()
    dist.all_reduce(sq, group=mesh.pp_group)
    return sq.sqrt()


def clip_pipeline_gradients(model, mesh: PipelineMesh, max_norm: float) -> torch.Tensor:
    """Scale every gradient so the global norm is at most ``max_norm`` (0: no clipping);
    return the norm before clipping."""
    norm = pipeline_grad_norm(model, mesh)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), max_norm, norm)
    return norm
