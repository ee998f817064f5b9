"""The identity codec: payloads travel as they are."""

from __future__ import annotations

import torch

from moeflow.comm.codecs.base import Codec, register_codec


@register_codec("none")
class NoCodec(Codec):
    lossless = True

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]

    def decode(self, payloads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        (x,) = payloads
        return x

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        return rows * cols * torch.empty((), dtype=dtype).element_size()
