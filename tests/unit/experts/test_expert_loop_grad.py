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


def test_grouped_autocast_sums_the_two_input_gradients_in_float32():
    """Under bf16 autocast the gated grouped path casts its input once, yet the gradients of
    ``W1 h`` and ``W3 h`` reach the float32 input each converted and summed in float32, bit for
    bit as two separate casts (torchtitan's experts) give; a bf16 sum first rounds once more."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    ffn = ExpertFFN(16, 32, 0, 4, "swiglu", seed=2)
    counts, gy = [3, 9, 0, 9], torch.randn(21, 16)
    x = torch.randn(21, 16)
    xa = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ffn(xa, counts)
    y.float().backward(gy)
    offs = torch.tensor([3, 12, 12, 21], dtype=torch.int32)
    w1, w2, w3 = (p.detach().bfloat16() for p in (ffn.w1, ffn.w2, ffn.w3))
    grads = []
    for separate in (True, False):
        xr = x.clone().requires_grad_()
        a = xr.bfloat16()
        b = xr.bfloat16() if separate else a
        h = F.silu(F.grouped_mm(a, w1, offs=offs)) * F.grouped_mm(b, w3, offs=offs)
        yr = F.grouped_mm(h, w2, offs=offs)
        yr.float().backward(gy)
        grads.append(xr.grad)
    assert xa.grad.dtype == torch.float32
    torch.testing.assert_close(y, yr, rtol=0, atol=0)
    torch.testing.assert_close(xa.grad, grads[0], rtol=0, atol=0)
    assert not torch.equal(grads[0], grads[1])        # the bf16 sum is another result
