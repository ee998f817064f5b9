"""The auxiliary loss delivered through the layer output's backward (gradient checkpointing).

A layer's ``aux_loss`` is normally added to the training loss by the caller. Under *reentrant*
activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``, or transformers'
``gradient_checkpointing_kwargs={"use_reentrant": True}``) the checkpointed forward runs under
``no_grad``: the ``aux_loss`` the caller sees has no graph, adding it to the loss changes the
value but trains nothing, and the forward recomputed in backward (which does have a graph) is
never added to any loss. The router silently stops receiving the balancing gradient.

The fix is Megatron-core's ``MoEAuxLossAutoScaler`` idea
(``megatron/core/transformer/moe/moe_utils.py``): the layer returns its output through an
autograd function that is the identity in forward and, in backward, passes the output's
gradient through unchanged and *also* feeds ``d total / d aux_loss = scale`` (1 by default)
into the aux loss's graph. Whatever computes the output's gradient (plain backward, a
reentrant recomputation, a non-reentrant one) then also back-propagates the aux loss, exactly
once per backward through the output. The caller must then not add the aux loss a second
time: a layer in this mode keeps only the detached value in ``aux_loss`` (for logging).
"""

from __future__ import annotations

import torch


class AttachAuxLoss(torch.autograd.Function):
    """``forward(y, aux_loss, scale) = y``; ``backward(g) = (g, scale * ones_like(aux_loss))``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        # only the aux loss's shape, dtype and device are needed (its graph is kept alive by
        # autograd through this node's inputs), so nothing is saved for backward
        ctx.aux_meta = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        ctx.scale = scale
        # returned as is (no copy); autograd makes it a view, so the caller must not modify
        # it in place (torch raises a clear error if it does)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_y, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_aux_loss(y: torch.Tensor, aux_loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``y`` whose backward also back-propagates ``aux_loss`` with gradient ``scale`` (the
    factor the caller applies to its own loss before backward, e.g. ``1 / accumulation_steps``
    or an AMP loss scale; 1 for a plain ``loss.backward()``)."""
    if not aux_loss.requires_grad or not torch.is_grad_enabled():
        return y
    return AttachAuxLoss.apply(y, aux_loss, float(scale))


def missing_aux_grad(layers) -> list[int]:
    """Indices of training-mode layers whose last ``aux_loss`` was computed without autograd
    although their router has trainable parameters: adding it to a loss would silently give
    the router no balancing gradient (the reentrant-checkpointing case)."""
    out = []
    for i, layer in enumerate(layers):
        loss = layer.aux_loss
        if (layer.training and loss is not None and not loss.requires_grad
                and not getattr(layer, "attach_aux_loss", False)
                and any(p.requires_grad for p in layer.router.parameters())):
            out.append(i)
    return out
