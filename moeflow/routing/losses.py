"""Router losses: the Switch/GShard load-balancing loss and the ST-MoE router z-loss."""

from __future__ import annotations

import torch


def balance_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` (Switch Transformer Eq. 4, GShard's l_aux).

    f_e: fraction of the T*k routing choices (before capacity dropping) that pick expert e;
    for k = 1 this is Switch's fraction of tokens dispatched to e. P_e: mean router probability
    of e over the T tokens. Uniform routing gives 1; f carries no gradient, P does.
    """
    T = probs.shape[0]
    if T == 0:
        return probs.sum() * 0.0
    flat = experts.reshape(-1)      # index_add, not bincount (which syncs on CUDA)
    f = probs.new_zeros(num_experts).index_add_(0, flat, torch.ones_like(flat, dtype=probs.dtype))
    f = f / experts.numel()
    return num_experts * torch.sum(f * probs.mean(dim=0))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE Eq. 5): mean over tokens of logsumexp(logits)^2."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()
