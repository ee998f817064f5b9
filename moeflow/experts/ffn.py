"""FFN experts ``E(h) = W2 act(W1 h)`` (GELU, ReLU) or SwiGLU ``W2 (silu(W1 h) * W3 h)``.

One module holds the ``E_local`` experts of this rank as stacked weights ``(E_local, ...)``;
expert ``first_expert + i`` is row ``i``, and its initial weights depend only on the seed, the
layer and its global id (layout-independent). Equal row counts per expert (capacity mode) run
as one batched matmul. Unequal (dropless) ones run as grouped GEMMs
(``torch.nn.functional.grouped_mm``: one launch per weight instead of one per expert; under
autocast the operands are cast to the autocast dtype first, as a dense ``Linear`` would be),
with one matmul per expert as the fallback where torch has no grouped GEMM, for float64, and
for widths whose rows are not 16-byte aligned (a grouped-GEMM layout requirement).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.init import seeded_normal

# Marks parameters whose copies live on a subset of ranks (expert shards), for sync_gradients.
EXPERT_PARAM_ATTR = "_moeflow_expert"


class ExpertFFN(nn.Module):
    def __init__(self, d_model: int, d_hidden: int, first_expert: int, num_local: int,
                 activation: str = "gelu", seed: int = 0, layer_id: int = 0):
        super().__init__()
        self.first_expert, self.num_local, self.activation = first_expert, num_local, activation
        ids = range(first_expert, first_expert + num_local)

        def stack(name: str, shape: tuple[int, int], fan_in: int) -> nn.Parameter:
            w = torch.stack([seeded_normal(shape, 1.0 / math.sqrt(fan_in), seed, "layer",
                                           layer_id, "expert", e, name) for e in ids])
            p = nn.Parameter(w)
            setattr(p, EXPERT_PARAM_ATTR, True)
            return p

        self.w1 = stack("w1", (d_model, d_hidden), d_model)
        if activation == "swiglu":
            self.w3 = stack("w3", (d_model, d_hidden), d_model)
        self.w2 = stack("w2", (d_hidden, d_model), d_hidden)

    def _act(self, h: torch.Tensor, x: torch.Tensor, w3: torch.Tensor | None) -> torch.Tensor:
        if self.activation == "swiglu":
            return F.silu(h) * (x @ w3 if x.dim() == 2 else torch.bmm(x, w3))
        return F.gelu(h) if self.activation == "gelu" else F.relu(h)

    def forward(self, x: torch.Tensor, counts: list[int],
                offsets: torch.Tensor | None = None) -> torch.Tensor:
        """``x: (R, M)`` rows grouped by local expert, ``counts[i]`` rows for expert i;
        ``offsets``: their int32 cumulative sums on ``x``'s device, if the caller has them."""
        if len(counts) != self.num_local or sum(counts) != x.shape[0]:
            raise ValueError(f"ExpertFFN got counts {counts} for {x.shape[0]} rows and "
                             f"{self.num_local} local experts")
        w1, w2 = self.w1.to(x.dtype), self.w2.to(x.dtype)
        w3 = self.w3.to(x.dtype) if self.activation == "swiglu" else None
        if len(set(counts)) == 1:                         # one batched matmul
            xs = x.reshape(self.num_local, counts[0], x.shape[1])
            h = self._act(torch.bmm(xs, w1), xs, w3)
            return torch.bmm(h, w2).reshape(x.shape[0], w2.shape[-1])
        if grouped_mm_fits(x, w1):
            return self._grouped(x, counts, offsets, w1, w2, w3)
        outs = []
        for i, xi in enumerate(torch.split(x, counts)):
            h = self._act(xi @ w1[i], xi, None if w3 is None else w3[i])
            outs.append(h @ w2[i])
        return torch.cat(outs)

    def _grouped(self, x, counts, offsets, w1, w2, w3) -> torch.Tensor:
        if offsets is None:
            offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32,
                                   device=x.device)
        if torch.is_autocast_enabled(x.device.type):   # grouped_mm is not on autocast's list
            dt = torch.get_autocast_dtype(x.device.type)
            x, w1, w2 = x.to(dt), w1.to(dt), w2.to(dt)
            w3 = None if w3 is None else w3.to(dt)
        h = F.grouped_mm(x, w1, offs=offsets)
        if self.activation == "swiglu":
            h = F.silu(h) * F.grouped_mm(x, w3, offs=offsets)
        else:
            h = F.gelu(h) if self.activation == "gelu" else F.relu(h)
        return _ContiguousGrad.apply(F.grouped_mm(h, w2, offs=offsets))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: grouped_mm's backward refuses a
    stride-0 (expanded) output gradient such as the one ``y.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` takes these operands: torch has it, the dtype is one it computes
    (not float64), and rows of both weights are 16-byte aligned."""
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16,
                                                       torch.float16):
        return False
    size = torch.empty((), dtype=x.dtype).element_size()
    return all((n * size) % 16 == 0 for n in w.shape[1:])
