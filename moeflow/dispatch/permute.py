"""Apply a :class:`DispatchPlan`: permute tokens into the send buffer, regroup received rows by
local expert, and combine returned rows into token outputs weighted by the gates.

All ops are index_select / index_copy / index_add, so autograd gives the inverse permutations;
there is no Python loop over tokens.
"""

from __future__ import annotations

import torch

from moeflow.dispatch.plan import DispatchPlan


def permute(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """``x: (T, M)`` -> send buffer ``(send_rows, M)``; unused capacity slots are zero."""
    rows = x.index_select(0, plan.token)
    if plan.dense_slots:
        return rows                                      # slot == arange: already in order
    return x.new_zeros(plan.send_rows, x.shape[1]).index_copy(0, plan.slot, rows)


def combine(back: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    """Returned rows ``(send_rows, M)`` -> ``(T, M)``: sum over kept choices of gate * output."""
    rows = back if plan.dense_slots else back.index_select(0, plan.slot)
    gate = weights[plan.token, plan.choice].to(back.dtype).unsqueeze(1)
    out = back.new_zeros(plan.num_tokens, back.shape[1])
    return out.index_add(0, plan.token, rows * gate)


def group_by_expert(recv: torch.Tensor, recv_counts: torch.Tensor
                    ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """Received rows (source-major, then local expert) -> expert-major rows.

    Returns the regrouped rows, rows per local expert, and the permutation used (None when the
    layout is a plain transpose handled by reshapes, i.e. equal counts).
    """
    ep, e_local = recv_counts.shape
    if e_local == 1 or ep == 1:
        return recv, recv_counts.sum(0).tolist(), None
    expert_of_row = torch.arange(e_local).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
    perm = torch.argsort(expert_of_row, stable=True).to(recv.device)
    return recv.index_select(0, perm), recv_counts.sum(0).tolist(), perm


def ungroup(out: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """Inverse of :func:`group_by_expert`: expert-major rows back to source-major order."""
    if perm is None:
        return out
    return out.new_empty(out.shape).index_copy(0, perm, out)
