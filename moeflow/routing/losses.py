"""Router losses: the Switch/GShard load-balancing loss and the ST-MoE router z-loss.

For top-k > 1 two definitions of the dispatch fraction ``f_e`` are in use
(``MoEConfig.balance_loss``):

* ``"all_choices"`` (the default): ``f_e`` counts all T*k choices, as Megatron-core does
  (``megatron/core/transformer/moe/moe_utils.py``, ``switch_load_balancing_loss_func``:
  ``E / (k T^2) * sum_e tokens_per_expert_e * sum_t p_{t,e}``, tokens counted over the top-k
  routing map).
* ``"first_choice"``: ``f_e`` counts each token's first choice only, as GShard (Algorithm 1,
  ``c_e`` from the top-1 expert), DeepSpeed-MoE (``deepspeed/moe/sharded_moe.py``,
  ``top2gating``: ``ce = mean(mask1)``, ``l_aux = mean(me * ce) * E^2``) and Tutel
  (``tutel/impls/losses.py``, ``gshard_loss``: the one-hot of ``top_ids[:, 0]``) do.

Both equal Switch Transformer's Eq. (4) for k = 1.
"""

from __future__ import annotations

import torch

# How f_e counts choices (MoEConfig.balance_loss); config keeps the same names without
# importing this package (the registries and config do not import each other).
BALANCE_LOSSES = ("all_choices", "first_choice")


def balance_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int,
                 choices: str = "all_choices") -> torch.Tensor:
    """``E * sum_e f_e * P_e`` (Switch Transformer Eq. 4, GShard's l_aux).

    f_e: with ``choices="all_choices"`` the fraction of the T*k routing choices (before
    capacity dropping) that pick expert e; with ``"first_choice"`` the fraction of the T tokens
    whose first choice (``experts[:, 0]``) is e; for k = 1 both are Switch's fraction of tokens
    dispatched to e. P_e: mean router probability of e over the T tokens. Uniform routing gives
    1; f carries no gradient, P does.
    """
    if choices not in BALANCE_LOSSES:
        raise ValueError(f"balance_loss choices={choices!r}: choose one of "
                         f"{', '.join(BALANCE_LOSSES)}")
    T = probs.shape[0]
    if T == 0:
        return probs.sum() * 0.0
    if choices == "first_choice":
        experts = experts[:, :1]
    flat = experts.reshape(-1)      # index_add, not bincount (which syncs on CUDA)
    f = probs.new_zeros(num_experts).index_add_(0, flat, torch.ones_like(flat, dtype=probs.dtype))
    f = f / experts.numel()
    return num_experts * torch.sum(f * probs.mean(dim=0))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE Eq. 5): mean over tokens of logsumexp(logits)^2."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()
