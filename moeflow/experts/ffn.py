"""FFN experts ``E(h) = W2 act(W1 h)`` or, with a gated activation, ``W2 act(W1 h, W3 h)``
(SwiGLU: ``silu(W1 h) * W3 h``; GPT-OSS's clamped SwiGLU).

``act`` is an activation of the registry in :mod:`moeflow.experts.activations` (gelu, relu,
swiglu, clamped_swiglu, user-registered ones) or any elementwise function of
``torch.nn.functional`` named in ``MoEConfig.activation`` (silu, mish, leaky_relu, ...).
With ``bias=True`` (Tutel's ``has_fc1_bias`` / ``has_fc2_bias``; GPT-OSS) the projections are
affine: ``W2 act(W1 h + b1) + b2`` (and ``W3 h + b3`` for a gated activation); biases are
initialised like ``nn.Linear``'s, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, from the expert's
global identity.

One module holds the ``E_local`` experts of this rank as stacked weights ``(E_local, ...)``;
expert ``first_expert + i`` is row ``i``, and its initial weights depend only on the seed, the
layer and its global id (layout-independent). Equal row counts per expert (capacity mode) run
as one batched matmul. Unequal (dropless) ones run as grouped GEMMs
(``torch.nn.functional.grouped_mm``: one launch per weight instead of one per expert; under
autocast the operands are cast to the autocast dtype first, as a dense ``Linear`` would be),
with one matmul per expert as the fallback where torch has no grouped GEMM, for float64, and
for widths whose rows are not 16-byte aligned (a grouped-GEMM layout requirement).

Expert sharding (Parm's ESP, ``shard=(s, n)``): the module holds shard s of n of every local
expert's hidden dimension, an exact slice of the global expert's weights (W1 / W3 columns,
W2 rows, b1 / b3 entries, so still layout-independent); its output is a partial sum. ``reduce``
(the ESP-AllReduce, :mod:`moeflow.strategies.parm.collectives`) sums the partials, and only then
is b2, which every shard holds whole, added; an ``EspReduce`` over ESP peers that hold the same
rows (Parm's baseline with the ESP group inside the MP group) also sets the gradients:
``reduce.output`` after b2, and :meth:`ExpertFFN.reduce_input_grad` (Megatron's ``f``), which
the scheduled experts' backward applies to the input gradient.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from moeflow.devices import cache_block_rows, to_device_async
from moeflow.experts.activations import Activation, build_activation
from moeflow.init import seeded_normal, seeded_uniform
from moeflow.registry import Registry

# Marks parameters whose copies live on a subset of ranks (expert shards), for sync_gradients.
EXPERT_PARAM_ATTR = "_moeflow_expert"
# Marks expert parameters that every ESP shard holds whole (b2), for gradient-norm clipping.
ESP_WHOLE_ATTR = "_moeflow_esp_whole"
# The dimension of each expert's weight that holds the hidden units (split by ESP shards).
HIDDEN_DIM = {"w1": 1, "w3": 1, "w2": 0, "b1": 0, "b3": 0}


class ExpertFFN(nn.Module):
    """The built-in expert module (``MoEConfig.expert_module="ffn"``). A registered expert
    module (``@moeflow.register_experts("name")``) subclasses it and keeps its constructor and
    ``forward(x, counts, offsets)`` contract and its layout: parameters stacked over the
    ``num_local`` experts from ``first_expert`` on (checkpoints, gradient sync and the Hugging
    Face conversion index them by global expert id)."""

    #: Unequal counts run as grouped GEMMs where they fit (``grouped_mm_fits``); set False on
    #: an instance to force the per-expert loop (``moeflow bench layer`` compares the two).
    use_grouped_mm: bool = True

    def __init__(self, d_model: int, d_hidden: int, first_expert: int, num_local: int,
                 activation: str | Activation = "gelu", seed: int = 0, layer_id: int = 0,
                 bias: bool = False, shard: tuple[int, int] = (0, 1), reduce=None,
                 activation_options: dict | None = None):
        super().__init__()
        self.act = (activation if isinstance(activation, Activation)
                    else build_activation(activation, activation_options))
        self.first_expert, self.num_local, self.activation = first_expert, num_local, \
            self.act.name
        gated = self.act.gated
        ids = range(first_expert, first_expert + num_local)
        s, n = shard
        if d_hidden % n or not 0 <= s < n:
            raise ValueError(f"ExpertFFN shard {s} of {n}: the hidden width {d_hidden} must be "
                             "a multiple of the shard count")
        self.shard, self.reduce = (s, n), reduce
        width = d_hidden // n
        hidden_dim = HIDDEN_DIM

        def stack(name: str, shape: tuple[int, ...], fan_in: int) -> nn.Parameter:
            init = seeded_uniform if len(shape) == 1 else seeded_normal
            w = torch.stack([init(shape, 1.0 / math.sqrt(fan_in), seed, "layer", layer_id,
                                  "expert", e, name) for e in ids])
            if n > 1 and name in hidden_dim:          # ESP: an exact slice of the global
                w = w.narrow(1 + hidden_dim[name], s * width, width).contiguous()
            p = nn.Parameter(w)
            setattr(p, EXPERT_PARAM_ATTR, True)
            if n > 1 and name not in hidden_dim:
                setattr(p, ESP_WHOLE_ATTR, True)
            return p

        self.w1 = stack("w1", (d_model, d_hidden), d_model)
        if gated:
            self.w3 = stack("w3", (d_model, d_hidden), d_model)
        self.w2 = stack("w2", (d_hidden, d_model), d_hidden)
        self.has_bias = bias
        if bias:
            self.b1 = stack("b1", (d_hidden,), d_model)
            if gated:
                self.b3 = stack("b3", (d_hidden,), d_model)
            self.b2 = stack("b2", (d_model,), d_hidden)

    def _add_bias(self, y: torch.Tensor, name: str, i: int | None,
                  rows: dict | None = None) -> torch.Tensor:
        """``y`` plus bias ``name`` of local expert ``i`` (``rows[name][i]``, the loop's
        unbound rows; of every expert, ``y`` stacked ``(E_local, rows, .)``, when ``i`` is
        None); ``y`` itself without biases."""
        if not self.has_bias or (name == "b2" and self._b2_outside):
            return y
        if i is not None:
            return y + rows[name][i]
        return y + getattr(self, name).to(y.dtype).unsqueeze(1)

    def _act(self, h: torch.Tensor, x: torch.Tensor, w3: torch.Tensor | None,
             i: int | None = None, rows: dict | None = None) -> torch.Tensor:
        if self.act.gated:
            up = x @ w3 if x.dim() == 2 else torch.bmm(x, w3)
            return self.act(h, self._add_bias(up, "b3", i, rows))
        return self.act(h)

    def forward(self, x: torch.Tensor, counts: list[int],
                offsets: torch.Tensor | None = None) -> torch.Tensor:
        """``x: (R, M)`` rows grouped by local expert, ``counts[i]`` rows for expert i;
        ``offsets``: their int32 cumulative sums on ``x``'s device, if the caller has them."""
        if self.reduce is None:
            return self._partial(x, counts, offsets)
        y = self.reduce(self._partial(x, counts, offsets))     # ESP: sum the shards' partials
        if self.has_bias:
            y = y + self.b2.to(y.dtype).index_select(0, _row_expert(counts, offsets, y.device))
        output = getattr(self.reduce, "output", None)           # EspReduce: replicated rows
        return y if output is None else output(y)

    def reduce_input_grad(self, g: torch.Tensor) -> torch.Tensor:
        """The input gradient of :meth:`forward` as the scheduled experts' backward computed it
        -> the one to send back: with ``reduce`` an ``EspReduce`` over peers holding the same
        rows, the mean of the shards' partial gradients over the ESP group (Megatron's ``f``,
        a collective issued on the schedule's lane); otherwise ``g`` itself."""
        fix = getattr(self.reduce, "input_grad", None)
        return g if fix is None else fix(g)

    @property
    def _b2_outside(self) -> bool:
        """A shard's partial output never holds b2 (it is added once, after the sum)."""
        return self.reduce is not None or self.shard[1] > 1

    def partial(self, x: torch.Tensor, counts: list[int],
                offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Parm's EP&ESP-AlltoAll (Section III-C): this shard's partial output, summed over
        the shards by the tokens' rank (local combine) instead of an ESP-AllReduce. b2 enters
        as ``b2 / n`` on every shard, so the sum holds it once; its gradient on every shard is
        the whole ``sum_rows g`` (every shard gets the same rows and the same output gradients),
        as for the replicated b2 of the ESP-AllReduce path. A whole expert (n = 1) is itself."""
        y = self._partial(x, counts, offsets)
        n = self.shard[1]
        if not self.has_bias or n == 1:
            return y
        b2 = _ReplicaShare.apply(self.b2.to(y.dtype), n)
        return y + b2.index_select(0, _row_expert(counts, offsets, y.device))

    def _partial(self, x: torch.Tensor, counts: list[int],
                 offsets: torch.Tensor | None = None) -> torch.Tensor:
        if len(counts) != self.num_local or sum(counts) != x.shape[0]:
            raise ValueError(f"ExpertFFN got counts {counts} for {x.shape[0]} rows and "
                             f"{self.num_local} local experts")
        w1, w2 = self.w1.to(x.dtype), self.w2.to(x.dtype)
        w3 = self.w3.to(x.dtype) if self.act.gated else None
        if len(set(counts)) == 1:                         # one batched matmul
            xs = x.reshape(self.num_local, counts[0], x.shape[1])
            h = self._act(self._add_bias(torch.bmm(xs, w1), "b1", None), xs, w3)
            y = self._add_bias(torch.bmm(h, w2), "b2", None)
            return y.reshape(x.shape[0], w2.shape[-1])
        if self.use_grouped_mm and grouped_mm_fits(x, w1):
            return self._grouped(x, counts, offsets, w1, w2, w3)
        # unbind, not w[i]: the backward of E slices w[i] would build E full-size (E, ...)
        # zero gradients and add them; unbind's backward stacks the E slice gradients once
        w1s, w2s = w1.unbind(0), w2.unbind(0)
        w3s = None if w3 is None else w3.unbind(0)
        biases = self._unbound_biases(x.dtype)
        outs = []
        for i, xi in enumerate(torch.split(x, counts)):
            h = self._act(self._add_bias(xi @ w1s[i], "b1", i, biases), xi,
                          None if w3s is None else w3s[i], i, biases)
            outs.append(self._add_bias(h @ w2s[i], "b2", i, biases))
        return torch.cat(outs)

    def _unbound_biases(self, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, ...]]:
        """Each bias as its per-expert rows (one ``unbind``, see the per-expert loop)."""
        if not self.has_bias:
            return {}
        return {name: getattr(self, name).to(dtype).unbind(0)
                for name in ("b1", "b2", "b3") if hasattr(self, name)}

    def _grouped(self, x, counts, offsets, w1, w2, w3) -> torch.Tensor:
        if offsets is None:
            offsets = to_device_async(list(itertools.accumulate(counts)), x.device, torch.int32)
        x3 = x                                          # W3's operand (gated activations)
        if torch.is_autocast_enabled(x.device.type):   # grouped_mm is not on autocast's list
            dt = torch.get_autocast_dtype(x.device.type)
            w1, w2 = w1.to(dt), w2.to(dt)
            w3 = None if w3 is None else w3.to(dt)
            x, x3 = (_CastForTwo.apply(x, dt) if w3 is not None and x.dtype != dt
                     else (x.to(dt),) * 2)
        rows = _row_expert(counts, offsets, x.device) if self.has_bias else None
        h = self._add_row_bias(F.grouped_mm(x, w1, offs=offsets), "b1", rows)
        if self.act.gated:
            h = self.act(h, self._add_row_bias(F.grouped_mm(x3, w3, offs=offsets), "b3", rows))
        else:
            h = self.act(h)
        y = self._add_row_bias(F.grouped_mm(h, w2, offs=offsets), "b2", rows)
        return _ContiguousGrad.apply(y)

    def _add_row_bias(self, y: torch.Tensor, name: str, rows: torch.Tensor | None
                      ) -> torch.Tensor:
        """``y`` (rows grouped by expert) plus each row's expert bias ``name``; ``rows``: the
        local expert of each row (:func:`_row_expert`)."""
        if not self.has_bias or (name == "b2" and self._b2_outside):
            return y
        return y + getattr(self, name).to(y.dtype).index_select(0, rows)


EXPERTS = Registry("experts", ExpertFFN)
register_experts = EXPERTS.register
register_experts("ffn")(ExpertFFN)


def _row_expert(counts: list[int], offsets: torch.Tensor | None,
                device: torch.device) -> torch.Tensor:
    """The local expert of each row of an expert-grouped buffer, on ``device`` without a host
    wait: from the counts when they are equal, else from the device offsets (searchsorted)."""
    if len(set(counts)) == 1:
        return torch.arange(len(counts), device=device).repeat_interleave(counts[0])
    if offsets is None:
        offsets = to_device_async(list(itertools.accumulate(counts)), device, torch.int32)
    return torch.searchsorted(offsets, torch.arange(sum(counts), device=device,
                                                    dtype=offsets.dtype), right=True)


class _ReplicaShare(torch.autograd.Function):
    """``b / n`` forward; the gradient passes whole: n replicas each add their share to one sum,
    and each replica's gradient is that of the one logical parameter."""

    @staticmethod
    def forward(ctx, b, n):
        return b / n

    @staticmethod
    def backward(ctx, g):
        return g, None


class _CastForTwo(torch.autograd.Function):
    """``x`` converted to ``dtype`` once, as one output for each GEMM of a gated activation
    (``W1 h`` and ``W3 h``): their input gradients come back separately and are summed in
    ``x``'s dtype (float32 under autocast). One output used twice would have autograd sum the
    two in ``dtype`` first: one more bf16 rounding of the input gradient than two casts of
    their own (two ``Linear`` layers under autocast, torchtitan's experts) take. The sum runs
    block by block on CPU (:func:`~moeflow.devices.cache_block_rows`): the two conversions
    stay in cache, less memory traffic than a bf16 sum converted afterwards."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        low = x.to(dtype)
        return low, low.view_as(low)

    @staticmethod
    @once_differentiable
    def backward(ctx, g1, g2):
        g = torch.empty(g1.shape, dtype=ctx.dtype, device=g1.device)
        step = cache_block_rows(g.shape[0], g.shape[-1], g.device)
        for s in range(0, g.shape[0], step):
            torch.add(g1[s:s + step].to(ctx.dtype), g2[s:s + step].to(ctx.dtype),
                      out=g[s:s + step])
        return g, None


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
    """Whether ``grouped_mm`` takes these operands, in the dtype they will have (the autocast
    dtype under autocast): torch has it; on CUDA only bfloat16 on compute capability >= 8.0
    (torch's CUDA kernel and its meta function check for BF16); on CPU float32, bfloat16 or
    float16 (not float64); and rows of both weights 16-byte aligned."""
    if not hasattr(F, "grouped_mm"):
        return False
    dt = (torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type)
          else x.dtype)
    if x.is_cuda:
        if dt != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif dt not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    size = torch.empty((), dtype=dt).element_size()
    return all((n * size) % 16 == 0 for n in w.shape[1:])
