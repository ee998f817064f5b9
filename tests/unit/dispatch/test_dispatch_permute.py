"""permute / combine as row gathers in both directions: gradients by gradcheck
and the GShard semantics (choice-major priority, capacity drops) against a slow loop."""

from __future__ import annotations

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
