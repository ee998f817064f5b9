"""Cast codecs ``fp16`` and ``bf16``: payloads travel in a 16-bit float format.

ScheMoE section 3.1 ("low-bit floating-point representations (16-bit ...)") and Table 6
("MoE w/FP16"). A cast runs on the tensor's own device (no host round trip).
"""

from __future__ import annotations

import torch

from moeflow.comm.codecs.base import Codec, register_codec


class CastCodec(Codec):
    """Sends ``x.to(wire_dtype)`` and casts back on receipt."""

    wire_dtype: torch.dtype = torch.float16

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.check_input(x)
        return [x.to(self.wire_dtype)]

    def decode(self, payloads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        (p,) = payloads
        return p.to(dtype)

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        return rows * cols * torch.empty((), dtype=self.wire_dtype).element_size()


@register_codec("fp16")
class Fp16Codec(CastCodec):
    """IEEE half precision (10 mantissa bits, round to nearest even).

    Error bound: ``|x^ - x| <= 2^-11 |x|`` for ``6.2e-5 <= |x| <= 65504`` (normal range);
    ``|x^ - x| <= 2^-25`` below it (subnormals); ``|x| > 65504`` overflows to ``inf``, so use
    ``bf16`` for payloads that can be that large.
    """

    wire_dtype = torch.float16
    error_bound = "|err| <= 2^-11 |x| + 2^-25 for |x| <= 65504 (overflows to inf above)"


@register_codec("bf16")
class Bf16Codec(CastCodec):
    """bfloat16 (7 mantissa bits, float32's exponent range, round to nearest even).

    Error bound: ``|x^ - x| <= 2^-8 |x|`` for every finite float32 ``x`` with
    ``|x| >= 1.2e-38`` (and ``<= 2^-134`` absolute below it).
    """

    wire_dtype = torch.bfloat16
    error_bound = "|err| <= 2^-8 |x| (+ 2^-134 absolute for float32 subnormals)"
