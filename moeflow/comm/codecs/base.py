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
    #: Plain-language error bound of a lossy codec (shown by ``moeflow bench codecs``).
    error_bound: str = "exact"
    #: False for codecs whose encoding garbles inf/NaN (quantizers, ZFP); the MoE layer then
    #: counts such values in ``stats["nonfinite_payload"]`` instead of failing mid-exchange.
    represents_nonfinite: bool = True
    #: Floating dtypes ``encode`` accepts; ``check_input`` rejects others with a clear error.
    dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

    def supports(self, dtype: torch.dtype, device: torch.device | str) -> bool:
        """Whether ``encode`` accepts a tensor of this dtype on this device."""
        return dtype in self.dtypes

    def check_input(self, x: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the problem if ``x`` is not a 2-D tensor this codec takes."""
        if x.dim() != 2:
            raise ValueError(f"codec {self.name!r}: encode expects a (rows, cols) tensor, got "
                             f"shape {tuple(x.shape)}; reshape it to 2-D first")
        if not self.supports(x.dtype, x.device):
            ok = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            raise ValueError(f"codec {self.name!r} does not take {x.dtype} tensors on "
                             f"{x.device.type}; it takes {ok}; cast the payload or pick another "
                             f"codec (MoEConfig.codec)")

    @abstractmethod
    def encode(self, x: torch.Tensor) -> list[torch.Tensor]: ...

    @abstractmethod
    def decode(self, payloads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        """Bytes this codec puts on the wire for a ``(rows, cols)`` tensor of ``dtype``."""


CODECS = Registry("codec", Codec)
register_codec = CODECS.register
