"""The per-expert loop of ``ExpertFFN`` (float64, or no grouped GEMM) takes each expert's
weights with one ``unbind`` of the stacked ``(E, ...)`` parameter: its backward stacks the E
slice gradients once, where indexing ``w[i]`` per expert would build E full-size zero
gradients and add them (E x the weight's size in memory traffic per parameter)."""

import pytest
import torch

from moeflow.experts import ExpertFFN


def _graph_nodes(y: torch.Tensor) -> list[str]:
    seen, todo, names = set(), [y.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        todo.extend(nxt for nxt, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("act,bias", [("swiglu", True), ("gelu", False)])
def test_loop_slices_weights_by_one_unbind_per_parameter(act, bias):
    ffn = ExpertFFN(8, 16, 0, 4, act, seed=3, bias=bias).double()
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    names = _graph_nodes(ffn(x, [1, 4, 0, 5]))
    assert "SelectBackward0" not in names
    assert names.count("UnbindBackward0") == len(list(ffn.parameters()))


def test_loop_and_grouped_paths_agree_in_float32():
    ffn = ExpertFFN(16, 32, 0, 4, "swiglu", seed=2, bias=True)
    x = torch.randn(21, 16)
    counts = [3, 9, 0, 9]
    got = []
    for grouped in (False, True):
        ffn.use_grouped_mm = grouped
        xi = x.clone().requires_grad_()
        y = ffn(xi, counts)
        y.square().sum().backward()
        got.append([y.detach(), xi.grad] + [p.grad.clone() for p in ffn.parameters()])
        ffn.zero_grad(set_to_none=True)
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
