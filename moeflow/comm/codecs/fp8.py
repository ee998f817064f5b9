"""The ``fp8`` codecs: scaled float8 e4m3 (``torch.float8_e4m3fn``) payloads.

ScheMoE section 3.1 mentions 8-bit floating-point payloads; this is the format current GPUs
(Hopper, Ada, Blackwell) convert in hardware. Each block of ``block`` consecutive values of a row
(``fp8``: 128 values; ``fp8-row``: the whole row) is scaled so its largest magnitude maps to 448,
e4m3's largest finite value, then rounded to e4m3 (round to nearest even). The float8 payload
travels as ``uint8`` (same bits; every backend can move bytes) with the float32 scales as a
second payload of shape ``(rows, blocks)``. CUDA tensors go through fused Triton kernels
(:mod:`.triton_quant`, same bits) when triton is installed; the torch code below runs everywhere
else.
"""

from __future__ import annotations

import math

import torch

from moeflow.comm.codecs.base import Codec, register_codec

E4M3_MAX = 448.0


class _Fp8Base(Codec):
    """Error bound: ``|x^ - x| <= 2^-4 |x| + 2^-10 * amax_b / 448`` for every element of block
    ``b`` (3 mantissa bits give half an ulp of ``2^-4`` relative in e4m3's normal range; below
    ``2^-6`` in scaled units e4m3 is subnormal with spacing ``2^-9``), plus float32 rounding of
    the scale. A block of zeros is exact. Inputs must be finite.
    Wire size: ``rows * cols`` bytes + 4 bytes per block (float32 scale).
    """

    block: int | None = 128
    represents_nonfinite = False
    error_bound = "|err| <= 2^-4 |x| + 2^-10 * (block amax) / 448"

    def _nblocks(self, cols: int) -> int:
        return 1 if self.block is None else max(1, math.ceil(cols / self.block))

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.check_input(x)
        if x.is_cuda:
            from moeflow.comm.codecs import triton_quant
            if triton_quant.available():
                return triton_quant.fp8_encode(x, self.block)
        rows, cols = x.shape
        nb = self._nblocks(cols)
        if cols == 0:                                   # nothing to send but the (zero) scales
            return [torch.empty(rows, 0, dtype=torch.uint8, device=x.device),
                    torch.zeros(rows, nb, device=x.device)]
        bs = cols if self.block is None else self.block
        xf = x.float()
        pad = nb * bs - cols
        if pad:
            xf = torch.nn.functional.pad(xf, (0, pad))
        xb = xf.view(rows, nb, bs)
        amax = xb.abs().amax(dim=2)
        scale = amax / E4M3_MAX
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = (xb * inv.unsqueeze(2)).to(torch.float8_e4m3fn).view(torch.uint8)
        return [q.reshape(rows, nb * bs)[:, :cols].contiguous(), scale]

    def decode(self, payloads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q, scale = payloads
        if q.is_cuda:
            from moeflow.comm.codecs import triton_quant
            if triton_quant.available():
                return triton_quant.fp8_decode(q, scale, self.block, dtype)
        rows, cols = q.shape
        if cols == 0:
            return torch.empty(rows, 0, dtype=dtype, device=q.device)
        nb = scale.shape[1]
        bs = cols if self.block is None else self.block
        v = q.view(torch.float8_e4m3fn).float()
        pad = nb * bs - cols
        if pad:
            v = torch.nn.functional.pad(v, (0, pad))
        out = v.view(rows, nb, bs) * scale.unsqueeze(2)
        return out.reshape(rows, nb * bs)[:, :cols].to(dtype)

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        return rows * cols + 4 * rows * self._nblocks(cols)


@register_codec("fp8")
class Fp8Codec(_Fp8Base):
    __doc__ = "e4m3 with one float32 scale per block of 128 values of a row.\n\n" + \
        (_Fp8Base.__doc__ or "")
    block = 128


@register_codec("fp8-row")
class Fp8RowCodec(_Fp8Base):
    __doc__ = "e4m3 with one float32 scale per row.\n\n" + (_Fp8Base.__doc__ or "")
    block = None
