"""The ``zfp`` and ``zfpy`` codecs: fixed-rate ZFP on all-to-all payloads (ScheMoE section
3.1 and Table 6: ZFP at 8 bits per value keeps model quality at a quarter of the volume).

Layout (both codecs, identical bytes): row ``r`` of the ``(rows, cols)`` payload is compressed
as its own 1-D zfp array (blocks of 4 consecutive values; a partial last block padded as zfp
pads it), so the payload is a uint8 ``(rows, nbytes)`` tensor that the all-to-all routes with
the same split sizes. ``nbytes = 8 * ceil(ceil(cols / 4) * maxbits / 64)`` with
``maxbits = 4 * rate``: the row's zfp stream, padded to 64-bit words as zfp pads a stream.
1-D blocks are chosen because rows are independent tokens; 2-D/3-D blocks are available through
:func:`moeflow.comm.codecs.zfp.compress`. A row's byte count does not tell its width (the last
block is padded), so a codec instance decodes rows of the width it last encoded, which is what
an all-to-all exchanges (every rank sends rows of ``d_model`` values); a mismatch raises.

``zfp`` is our implementation (any device; CUDA tensors use the Triton kernels when
``triton`` is installed, CPU tensors the compiled numba coder, else the same torch code); ``zfpy`` wraps LLNL's ``zfpy`` (CPU tensors
only) and serves as the reference.
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.comm.codecs import zfp
from moeflow.comm.codecs.base import Codec, register_codec
from moeflow.comm.codecs.zfp.transform import stream_bytes
from moeflow.errors import ConfigError

class _ZfpBase(Codec):
    """Fixed-rate ZFP, ``rate`` bits per value (default 8: a quarter of float32).

    Error bound: fixed-rate ZFP bounds the error of each block of 4 values relative to the
    block's largest magnitude (``2^emax``, ``emax`` its frexp exponent), not relative to each
    value: ``maxbits - 9`` bits code 4 coefficients, so about ``(4 rate - 9) / 4`` bit planes
    below ``2^emax`` survive. Documented (empirical) bound, checked by the tests:
    ``|err| <= 2^emax * min(4, 2^(4 - (4 rate - 9) / 4))`` (rate 8: ``2^(emax - 1.75)``); the
    worst case measured on Gaussian, uniform, heavy-tailed and sparse rows is ``2^-0.6`` below
    it for rates 6-24. Decoded values equal zfpy's bit for bit. Non-finite values are not
    representable in ZFP: by default they are sent as zfp sends them, garbling their block
    (the MoE layer counts them in ``stats["nonfinite_payload"]``, on every rank alike, rather
    than raising on one rank while its peers wait in the all-to-all); ``check_finite=True``
    rejects them with a ``ValueError`` for standalone use.
    """

    lossless = False
    rate: float = 8.0
    check_finite: bool = False
    represents_nonfinite = False
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    error_bound = "|err| <= 2^emax_block * min(4, 2^(4 - (4*rate - 9)/4)) per block of 4"

    def __init__(self, rate: float | None = None, check_finite: bool | None = None):
        if rate is not None:
            self.rate = rate
        if check_finite is not None:
            self.check_finite = check_finite
        zfp.maxbits_for(self.rate, 1)                      # validates the rate

    def _check(self, x: torch.Tensor) -> None:
        self.check_input(x)
        if self.check_finite and x.numel() and not bool(torch.isfinite(x).all()):
            raise ValueError(f"codec {self.name!r}: the payload holds inf or NaN, which ZFP "
                             "cannot represent; fix the overflow upstream or build the codec "
                             "with check_finite=False to send them as zfp would (garbled)")

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        if cols == 0:
            return 0
        return rows * stream_bytes(-(-cols // 4), zfp.maxbits_for(self.rate, 1))


    def _cols_for(self, nbytes: int) -> int:
        cols = getattr(self, "_cols", None)
        if cols is None or self.wire_bytes(1, cols, torch.float32) != nbytes:
            raise ValueError(f"codec {self.name!r}: cannot tell the row width of a {nbytes}-byte "
                             f"zfp row (last encoded width: {cols}); a zfp codec decodes rows "
                             "of the width it last encoded, as in an all-to-all")
        return cols


@register_codec("zfp")
class ZfpCodec(_ZfpBase):
    __doc__ = _ZfpBase.__doc__

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._check(x)
        self._cols = x.shape[1]
        if x.numel() == 0:
            return [torch.empty(x.shape[0], self.wire_bytes(1, x.shape[1], x.dtype),
                                dtype=torch.uint8, device=x.device)]
        if x.is_cuda:
            from moeflow.comm.codecs.zfp import triton_backend
            if triton_backend.available():
                return [triton_backend.compress_rows(x.float().contiguous(), self.rate)]
        return [zfp.compress(x, self.rate, dims=1)]

    def decode(self, payloads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        (p,) = payloads
        if p.shape[1] == 0:
            return torch.empty(p.shape[0], 0, dtype=dtype, device=p.device)
        cols = self._cols_for(p.shape[1])
        if p.shape[0] == 0:
            return torch.empty(0, cols, dtype=dtype, device=p.device)
        if p.is_cuda:
            from moeflow.comm.codecs.zfp import triton_backend
            if triton_backend.available():
                return triton_backend.decompress_rows(p, cols, self.rate).to(dtype)
        return zfp.decompress(p, (p.shape[0], cols), self.rate, dims=1, dtype=dtype)


@register_codec("zfpy")
class ZfpyCodec(_ZfpBase):
    """LLNL's ``zfpy`` on CPU tensors (the reference for ``zfp``; same payload bytes).

    """ + (_ZfpBase.__doc__ or "").split("\n\n", 1)[1] + """
    CUDA tensors are rejected with a ``ConfigError`` (zfpy is CPU-only; use ``zfp``).
    """

    def supports(self, dtype: torch.dtype, device) -> bool:
        return dtype in self.dtypes and torch.device(device).type == "cpu"

    def _need_cpu(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            raise ConfigError(f"MoEConfig.codec='zfpy' is invalid for {t.device.type} tensors: "
                              "zfpy runs on CPU only; use codec='zfp' (same format, any device)")

    @staticmethod
    def _zfpy():
        try:
            import zfpy
        except ImportError as err:                         # pragma: no cover
            raise ConfigError("MoEConfig.codec='zfpy' needs the zfpy package: pip install "
                              "'moeflow[zfp]' (or pick codec='zfp')") from err
        return zfpy

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._need_cpu(x)
        self._check(x)
        zfpy = self._zfpy()
        rows, cols = x.shape
        self._cols = cols
        nb = self.wire_bytes(1, cols, torch.float32)
        a = x.detach().float().contiguous().numpy()
        if rows == 0 or cols == 0:
            return [torch.empty(rows, nb, dtype=torch.uint8)]
        if cols % 4 == 0 and (cols // 4) * zfp.maxbits_for(self.rate, 1) % 64 == 0:
            # rows fill whole blocks and whole words: one call codes every row's stream
            buf = zfpy.compress_numpy(a.reshape(-1), rate=self.rate, write_header=False)
            return [torch.frombuffer(bytearray(buf), dtype=torch.uint8).reshape(rows, nb)]
        out = np.empty((rows, nb), dtype=np.uint8)
        for r in range(rows):
            out[r] = np.frombuffer(zfpy.compress_numpy(a[r], rate=self.rate,
                                                       write_header=False), dtype=np.uint8)
        return [torch.from_numpy(out)]

    def decode(self, payloads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        (p,) = payloads
        self._need_cpu(p)
        zfpy = self._zfpy()
        rows = p.shape[0]
        if p.shape[1] == 0:
            return torch.empty(rows, 0, dtype=dtype)
        cols = self._cols_for(p.shape[1])
        if rows == 0:
            return torch.empty(0, cols, dtype=dtype)
        buf = p.contiguous().numpy()
        if cols % 4 == 0 and (cols // 4) * zfp.maxbits_for(self.rate, 1) % 64 == 0:
            out = zfpy._decompress(buf.tobytes(), zfpy.type_float, [rows * cols],
                                   rate=self.rate).reshape(rows, cols)
        else:
            out = np.stack([zfpy._decompress(buf[r].tobytes(), zfpy.type_float, [cols],
                                             rate=self.rate) for r in range(rows)])
        return torch.from_numpy(np.ascontiguousarray(out)).to(dtype)
