"""Apply a :class:`DispatchPlan`: permute tokens into the send buffer and combine returned rows
into token outputs weighted by the gates.

All ops are index_select / index_copy / reshapes with shapes known on the host, so autograd
gives the inverse permutations and nothing waits for the device; there is no Python loop over
tokens. The regrouping of received rows by local expert lives in :mod:`moeflow.schedule.chunks`
(it depends on the pipelined chunk).
"""

from __future__ import annotations

import torch

from moeflow.dispatch.plan import DispatchPlan


def permute(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """``x: (T, M)`` -> send buffer ``(send_rows, M)``; unused capacity slots are zero."""
    T, k = plan.num_tokens, plan.top_k
    if plan.dense_slots:                                   # row i holds choice slot[i]
        token = plan.slot if k == 1 else torch.remainder(plan.slot, T)
        return x.index_select(0, token)
    # Choice a = j*T + t reads token t; dropped choices land on the scratch row, cut off.
    rows = x if k == 1 else x.repeat(k, 1)
    buf = x.new_zeros(plan.send_rows + 1, x.shape[1]).index_copy(0, plan.slot, rows)
    return buf.narrow(0, 0, plan.send_rows)


def combine(back: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    """Returned rows ``(send_rows, M)`` -> ``(T, M)``: sum over kept choices of gate * output,
    summed in choice order for every token (deterministic, no atomics)."""
    T, k, M = plan.num_tokens, plan.top_k, back.shape[1]
    gate = weights.t().reshape(-1).to(back.dtype)          # (T*k,) choice-major like the plan
    if plan.dense_slots:                 # fewer rows than choices: HECATE's plan keeps only
        make = back.new_empty if plan.send_rows == T * k else back.new_zeros   # kept ones
        rows = make(T * k, M).index_copy(0, plan.slot, back)
    else:
        kept = plan.slot < plan.send_rows
        rows = back.index_select(0, plan.slot.clamp(max=max(plan.send_rows - 1, 0)))
        gate = gate * kept.to(gate.dtype)
    return (rows * gate.unsqueeze(1)).view(k, T, M).sum(0)
