"""The ``int8`` codec: affine 8-bit quantization with a per-row scale and offset.

ScheMoE section 3.1 lists 8-bit payloads; Table 6 ("MoE w/INT8") shows its accuracy cost. Each
row ``r`` is sent as ``q = round((x - lo_r) / s_r)`` in ``uint8`` with ``s_r = (hi_r - lo_r)/255``
and ``(s_r, lo_r)`` as two extra float32 payloads of shape ``(rows, 1)``, so every payload keeps
``rows`` as its first dimension. Decoding is ``q * s_r + lo_r`` with two roundings (not
``torch.addcmul``, whose fused or unfused rounding depends on ATen's CPU capability). CUDA tensors
go through fused Triton kernels (:mod:`.triton_quant`, same bits) when triton is installed; the
torch code below runs everywhere else.
"""

from __future__ import annotations

import torch

from moeflow.comm.codecs.base import Codec, register_codec


@register_codec("int8")
class Int8Codec(Codec):
    """Per-row min/max affine uint8 quantization.

    Error bound: ``|x^ - x| <= (max_r - min_r) / 510`` for every element of row ``r``, plus
    float32 rounding (``<= 2^-22 max_r|x|``). A constant row is exact. Rows must be finite.
    Wire size: ``rows * cols`` bytes + 8 bytes per row (float32 scale and offset).
    """

    represents_nonfinite = False
    error_bound = "|err| <= (row max - row min) / 510 (+ float32 rounding)"

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.check_input(x)
        if x.is_cuda:
            from moeflow.comm.codecs import triton_quant
            if triton_quant.available():
                return triton_quant.int8_encode(x)
        xf = x.float()
        if xf.shape[1] == 0:
            lo = hi = torch.zeros(xf.shape[0], 1, device=x.device)
        else:
            lo = xf.amin(dim=1, keepdim=True)
            hi = xf.amax(dim=1, keepdim=True)
        scale = (hi - lo) / 255.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = ((xf - lo) * inv).round_().clamp_(0, 255).to(torch.uint8)
        return [q, scale, lo]

    def decode(self, payloads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q, scale, lo = payloads
        if q.is_cuda:
            from moeflow.comm.codecs import triton_quant
            if triton_quant.available():
                return triton_quant.int8_decode(q, scale, lo, dtype)
        return (q.float() * scale + lo).to(dtype)

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        return rows * cols + 8 * rows
