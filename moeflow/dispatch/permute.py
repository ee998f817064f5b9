"""Apply a :class:`DispatchPlan`: permute tokens into the send buffer and combine returned rows
into token outputs weighted by the gates.

Both directions are row gathers (``index_select``) only, forward and backward (no scatter-add,
no atomics):
``permute`` gathers each send row's token (its backward gathers each choice's row and sums the
k choices of a token); ``combine`` gathers each choice's row and sums the k gate-weighted rows
(its backward gathers each send row's token gradient, times that row's gate). On CPU a
row gather is about 100x faster than the scatters autograd would use otherwise
(``index_add_`` for the backward of ``index_select``, ``index_copy`` to build the buffer),
which is what Tutel's fused C++ dispatch loop avoids too. Shapes are known on the host and
nothing waits for the device; there is no Python loop over tokens, only, on CPU, the
combine's loop over cache-sized blocks of them (its temporaries stay in cache). The
regrouping of received rows by local expert lives in :mod:`moeflow.schedule.chunks` (it
depends on the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from moeflow.devices import cache_block_rows
from moeflow.dispatch.plan import DispatchPlan


@dataclass
class _Maps:
    """Both directions of the plan as gather indices (device tensors, built once per plan)."""

    row_of_choice: torch.Tensor          # (T*k,) send row of choice a, clamped (see kept)
    kept: torch.Tensor | None            # (T*k,) bool, None when every choice has a row
    token_of_row: torch.Tensor           # (S,) token of send row i (0 for an empty row)
    choice_of_row: torch.Tensor          # (S,) choice held by row i; T*k for an empty row
    valid_row: torch.Tensor | None       # (S,) bool, None when no row is empty


def _maps(plan: DispatchPlan) -> _Maps:
    cached = getattr(plan, "_gather_maps", None)
    if cached is not None:
        return cached
    T, S = plan.num_tokens, plan.send_rows
    n = T * plan.top_k
    if plan.dense_slots:                                 # dropless: row i holds slot[i]
        choice_of_row, valid = plan.slot, None
        rows = torch.arange(S, dtype=plan.slot.dtype, device=plan.slot.device)
        if S == n:                                       # every choice has a row
            row_of_choice = torch.empty_like(plan.slot).index_copy_(0, plan.slot, rows)
            kept = None
        else:            # HECATE's plan keeps only some choices: the others have no row
            row_of_choice = plan.slot.new_full((n,), S).index_copy_(0, plan.slot, rows)
            kept = row_of_choice < S
            row_of_choice = row_of_choice.clamp(max=max(S - 1, 0))
    else:                                                # capacity: choice a -> row slot[a]
        kept = plan.slot < S
        row_of_choice = plan.slot.clamp(max=max(S - 1, 0))
        choice_of_row = torch.full((S + 1,), n, dtype=plan.slot.dtype,
                                   device=plan.slot.device).index_copy_(
            0, plan.slot, torch.arange(n, device=plan.slot.device)).narrow(0, 0, S)
        valid = choice_of_row < n
    maps = _Maps(row_of_choice, kept, torch.remainder(choice_of_row, T), choice_of_row, valid)
    plan._gather_maps = maps
    return maps


def _spread(x: torch.Tensor, m: _Maps, weight_row: torch.Tensor | None) -> torch.Tensor:
    """``out[i] = x[token_of_row[i]] * w[i]`` (0 for empty rows)."""
    out = x.index_select(0, m.token_of_row)
    if weight_row is not None:
        out.mul_(weight_row.unsqueeze(1))
    elif m.valid_row is not None:
        out.mul_(m.valid_row.unsqueeze(1).to(out.dtype))
    return out


def _collect(src: torch.Tensor, m: _Maps, k: int, T: int) -> torch.Tensor:
    """``y[t] = sum_j g[j,t] * src[row_of_choice[j*T+t]]`` summed in choice order (``g``: the
    kept mask)."""
    rows = src.index_select(0, m.row_of_choice).view(k, T, src.shape[1])
    w = None if m.kept is None else m.kept.to(src.dtype)
    if w is None:
        return rows.sum(0)
    w = w.view(k, T, 1)
    y = rows[0] * w[0]
    for j in range(1, k):
        y.addcmul_(rows[j], w[j])
    return y


def _weighted_sum(src: torch.Tensor, m: _Maps, k: int, T: int, gate: torch.Tensor
                  ) -> torch.Tensor:
    """``y[t] = sum_j gate[j*T+t] * src[row_of_choice[j*T+t]]`` in ``gate``'s dtype, summed in
    choice order, block by block of tokens. Rows of a lower precision (bf16 expert outputs,
    float32 gates) are converted exactly first: a product of mixed dtypes would take the CPU's
    element-by-element casting path, and after the conversion every product and sum is the
    float32 path's own operation (bit for bit the float32 combine of the same values)."""
    y = torch.empty(T, src.shape[1], dtype=gate.dtype, device=src.device)
    w, rows = gate.view(k, T, 1), m.row_of_choice.view(k, T)
    step = cache_block_rows(T, src.shape[1], src.device)
    for s in range(0, T, step):
        e = min(T, s + step)
        out = y[s:e]
        for j in range(k):
            r = src.index_select(0, rows[j, s:e]).to(gate.dtype)
            if j == 0:
                torch.mul(r, w[0, s:e], out=out)
            else:
                out.addcmul_(r, w[j, s:e])
    return y


def _weighted_sum_grads(gy: torch.Tensor, back: torch.Tensor, gate: torch.Tensor, m: _Maps,
                        want_back: bool, want_gate: bool):
    """The gradients of :func:`_weighted_sum` for the rows (``gy[token(i)] * gate(i)``, in
    ``back``'s dtype) and the gates (``<back[i], gy[token(i)]>`` per row, then per choice),
    computed in ``gy``'s dtype block by block of rows: each row's token gradient is gathered
    once for both."""
    S, M = back.shape
    grad_back = torch.empty_like(back) if want_back else None
    per_row = gy.new_empty(S) if want_gate else None
    if want_back:                                 # each row's gate; empty rows carry none
        gate_row = torch.cat([gate, gate.new_zeros(1)]).index_select(
            0, m.choice_of_row).unsqueeze(1)
    step = cache_block_rows(S, M, back.device)
    for s in range(0, S, step):
        e = min(S, s + step)
        g_rows = gy.index_select(0, m.token_of_row[s:e])
        if want_gate:
            rows = back[s:e]
            prod = (rows * g_rows if rows.dtype == g_rows.dtype
                    else rows.to(g_rows.dtype).mul_(g_rows))
            torch.sum(prod, -1, out=per_row[s:e])
        if want_back:
            grad_back[s:e].copy_(g_rows.mul_(gate_row[s:e]))
    grad_gate = per_row.index_select(0, m.row_of_choice) if want_gate else None
    return grad_back, grad_gate


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, maps, k, T):
        ctx.maps, ctx.k, ctx.T = maps, k, T
        return _spread(x, maps, None)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return _collect(g.contiguous(), ctx.maps, ctx.k, ctx.T), None, None, None


class _Combine(torch.autograd.Function):
    """The gate-weighted sum; ``back`` may be lower precision than ``gate`` (bf16 expert
    outputs, float32 gates): the products and the sum are then in ``gate``'s dtype, on rows
    converted exactly first, block by block (:func:`_weighted_sum`). The rows' gradient is
    computed in ``gate``'s dtype and returned in ``back``'s."""

    @staticmethod
    def forward(ctx, back, gate, maps, k, T):
        ctx.maps, ctx.k, ctx.T = maps, k, T
        ctx.save_for_backward(back, gate)
        return _weighted_sum(back, maps, k, T, gate)

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        back, gate = ctx.saved_tensors
        grad_back, grad_gate = _weighted_sum_grads(
            gy.contiguous(), back, gate, ctx.maps, ctx.needs_input_grad[0],
            ctx.needs_input_grad[1])
        return grad_back, grad_gate, None, None, None


def permute(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """``x: (T, M)`` -> send buffer ``(send_rows, M)``; unused capacity slots are zero."""
    if plan.num_tokens == 0 or plan.send_rows == 0:
        return x.new_zeros(plan.send_rows, x.shape[1]) + x.sum() * 0
    return _Permute.apply(x, _maps(plan), plan.top_k, plan.num_tokens)


def combine(back: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Returned rows ``(send_rows, M)`` -> ``(T, M)``: sum over kept choices of gate * output,
    summed in choice order for every token (deterministic, no atomics), in the gates'
    precision at least: expert outputs in bf16 / fp16 (autocast, a bf16 model) are weighted
    and summed in the router's float32, as torchtitan's and Megatron-core's combines do, then
    cast to ``out_dtype`` (the layer input's dtype; ``back``'s when None)."""
    T, k, M = plan.num_tokens, plan.top_k, back.shape[1]
    out_dtype = back.dtype if out_dtype is None else out_dtype
    acc = torch.promote_types(back.dtype, weights.dtype)
    if T == 0 or plan.send_rows == 0:
        return (back.new_zeros(T, M, dtype=out_dtype) + back.sum().to(out_dtype) * 0
                + weights.sum().to(out_dtype) * 0)
    m = _maps(plan)
    gate = weights.t().reshape(-1).to(acc)                 # (T*k,) choice-major like the plan
    if m.kept is not None:
        gate = gate * m.kept.to(gate.dtype)
    return _Combine.apply(back.contiguous(), gate, m, k, T).to(out_dtype)
