"""permute / combine as row gathers in both directions: gradients by gradcheck
and the GShard semantics (choice-major priority, capacity drops) against a slow loop."""

from __future__ import annotations

import importlib

import pytest
import torch

from moeflow.dispatch import combine, make_plan, permute


@pytest.mark.parametrize("cap", [3, None, 100])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_gathers_match_the_loop_and_gradcheck(cap, k):
    torch.manual_seed(k)
    T, M, E = 13, 5, 4
    x = torch.randn(T, M, dtype=torch.float64, requires_grad=True)
    ex = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k, dtype=torch.float64, requires_grad=True)
    plan = make_plan(ex, E, cap)
    assert torch.autograd.gradcheck(lambda a: permute(a, plan), (x,))
    b = torch.randn(plan.send_rows, M, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, g: combine(a, plan, g), (b, w))
    ref, seen = torch.zeros(T, M, dtype=torch.float64), [0] * E
    for j in range(k):                       # priority: all first choices, then second, ...
        for t in range(T):
            e = int(ex[t, j])
            if cap is None or seen[e] < cap:
                ref[t] += w[t, j] * x[t]
            seen[e] += 1
    torch.testing.assert_close(combine(permute(x, plan), plan, w), ref)


def test_empty_rank():
    plan = make_plan(torch.zeros(0, 2, dtype=torch.long), 4, 2)
    x = torch.zeros(0, 3, requires_grad=True)
    send = permute(x, plan)
    assert send.shape == (8, 3) and not send.any()
    y = combine(send, plan, torch.zeros(0, 2))
    y.sum().backward()
    assert y.shape == (0, 3) and x.grad.shape == (0, 3)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("cap", [3, None])
def test_low_precision_rows_are_summed_in_the_gates_precision(cap, k, low):
    """bf16 expert outputs with float32 gates (autocast): the weighted sum, its output and both
    gradients equal the float32 computation on the same bf16 values bit for bit (no bf16
    rounding of the products or the sum: the same float32 operations on exactly converted
    rows); the rows' gradient comes back in bf16, the float32 one rounded once."""
    torch.manual_seed(0)
    T, M, E = 11, 6, 4
    ex = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    plan = make_plan(ex, E, cap)
    b16 = torch.randn(plan.send_rows, M).to(low).requires_grad_()
    b32 = b16.detach().float().requires_grad_()
    w16, w32 = (torch.rand(T, k, requires_grad=True) for _ in range(2))
    with torch.no_grad():
        w32.copy_(w16)
    gy = torch.randn(T, M)
    y16 = combine(b16, plan, w16, torch.float32)
    y32 = combine(b32, plan, w32)
    assert y16.dtype == torch.float32
    torch.testing.assert_close(y16, y32, rtol=0, atol=0)
    y16.backward(gy)
    y32.backward(gy)
    assert b16.grad.dtype == low
    torch.testing.assert_close(w16.grad, w32.grad, rtol=0, atol=0)
    torch.testing.assert_close(b16.grad, b32.grad.to(low), rtol=0, atol=0)
    # the former sum in the rows' precision (gates cast down) is not the float32 one
    old = combine(b16.detach(), plan, w16.detach().to(low))
    assert (old.float() - y32).abs().max() > (y16 - y32).abs().max()


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("cap", [3, None])
def test_combine_blocks_agree_with_one_block(monkeypatch, cap, block):
    """The combine's CPU blocks (cache-sized at real widths; forced small here) change no bit:
    output and both gradients, float32 and bf16 rows, equal those of one block, and the
    blocked float64 combine passes gradcheck."""
    pm = importlib.import_module("moeflow.dispatch.permute")    # the package's name is the function
    torch.manual_seed(1)
    T, M, E, k = 13, 6, 4, 2
    ex = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    plan = make_plan(ex, E, cap)
    w0, gy = torch.rand(T, k), torch.randn(T, M)
    b0 = torch.randn(plan.send_rows, M)

    def run(dtype):
        b, w = b0.to(dtype).clone().requires_grad_(), w0.clone().requires_grad_()
        y = combine(b, plan, w, torch.float32)
        y.backward(gy)
        assert b.grad.dtype == dtype and w.grad is not None
        return y.detach(), b.grad, w.grad

    ones = {dt: run(dt) for dt in (torch.float32, torch.bfloat16)}
    monkeypatch.setattr(pm, "cache_block_rows", lambda rows, width, device: block)
    for dt, want in ones.items():
        for got, ref in zip(run(dt), want):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
    b = b0.double().requires_grad_()
    w = w0.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, g: combine(a, plan, g), (b, w))
