"""Global gradient-norm clipping for replicated + expert-sharded parameters.

``torch.nn.utils.clip_grad_norm_`` would see only this rank's experts, so ranks would compute
different norms and their replicated parameters would drift apart. Here the squared norm of the
expert gradients is summed over the expert-parallel group (each expert counted once) and added
to the replicated part (identical on every rank after sync_gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.parallel.grad_sync import is_expert_param
from moeflow.topology import Topology


def global_grad_norm(model: nn.Module, topo: Topology) -> torch.Tensor:
    rep, exp = [], []
    for p in model.parameters():
        if p.grad is not None:
            (exp if is_expert_param(p) else rep).append(p.grad.detach().double().square().sum())
    zero = torch.zeros((), dtype=torch.float64)
    rep_sq = torch.stack(rep).sum() if rep else zero
    exp_sq = torch.stack(exp).sum() if exp else zero.clone()
    if topo.ep_size > 1:
        dist.all_reduce(exp_sq, group=topo.ep_group)
    return (rep_sq + exp_sq).sqrt()


def clip_gradients(model: nn.Module, topo: Topology, max_norm: float) -> float:
    """Scale all gradients so their global norm is at most ``max_norm``; return the norm."""
    norm = global_grad_norm(model, topo)
    if max_norm > 0:
        scale = min(1.0, max_norm / (float(norm) + 1e-6))
        if scale < 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
    return float(norm)
