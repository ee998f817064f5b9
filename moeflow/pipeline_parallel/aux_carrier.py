"""The MoE layers' auxiliary (balancing) loss of a pipeline stage, carried on its output.

A pipeline stage's backward starts from the gradient of its output, which the next stage
sends; only the last stage has a loss. A stage's balancing loss (Switch Transformer, Fedus et
al. 2022 Section 2.2; GShard) would be dropped. :func:`carry_aux` returns the activation
unchanged and, in backward, gives the auxiliary loss the gradient ``scale`` (its weight in the
step's loss), so the stage's routers get ``scale * d aux / d theta`` added in the same backward
as the activation's gradient (Megatron-core's MoEAuxLossAutoScaler does the same).
"""

from __future__ import annotations

import torch


class _CarryAux(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype, ctx.aux_device = aux.shape, aux.dtype, aux.device
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype,
                              device=ctx.aux_device)
        return grad, aux_grad, None


def carry_aux(x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """``x``, with ``scale * aux`` added to the loss its backward differentiates."""
    if not aux.requires_grad:
        return x
    return _CarryAux.apply(x, aux, scale)
