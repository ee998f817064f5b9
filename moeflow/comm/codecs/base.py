"""The codec interface and its registry (ScheMoE section 3.1, Listing 1)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from moeflow.registry import Registry


class Codec(ABC):
    """Encodes all-to-all payloads row-wise.

    ``encode(x)`` with ``x: (rows, cols)`` returns a list of tensors, each with ``rows`` as its
    first dimension; ``decode(payloads, dtype)`` inverts it. ``lossless`` codecs must reproduce
    ``x`` exactly; lossy ones document their error bound in ``error_bound``.
    """

    name: str = "?"
    lossless: bool = False

    @abstractmethod
    def encode(self, x: torch.Tensor) -> list[torch.Tensor]: ...

    @abstractmethod
    def decode(self, payloads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        """Bytes this codec puts on the wire for a ``(rows, cols)`` tensor of ``dtype``."""


CODECS = Registry("codec", Codec)
register_codec = CODECS.register
