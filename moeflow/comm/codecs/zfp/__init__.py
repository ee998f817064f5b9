"""ZFP fixed-rate compression of float arrays on any torch device: our implementation of LLNL
zfp's fixed-rate mode (Lindstrom 2014, "Fixed-rate compressed floating-point arrays"), the
compressor ScheMoE (section 3.1, Table 6) applies to all-to-all payloads.

``compress(a, rate, dims)`` returns, for each ``dims``-dimensional slice of ``a`` (zfp's x is
the last axis; leading axes are a batch of independent arrays), exactly the bytes
``zfpy.compress_numpy(slice, rate=rate, write_header=False)`` returns; ``decompress`` returns
exactly what zfpy decodes from them. Two coders run: :mod:`.numba_backend` (with
:mod:`.numba_planes`, :mod:`.numba_simd`; compiled, for CPU tensors) and the Triton kernels
(:mod:`.triton_backend` for 1-D, :mod:`.triton_nd` for 2-D/3-D; CUDA tensors when triton is
installed). Tensors on any other device (or CUDA without triton) are copied to the CPU, coded
there and copied back. :mod:`.transform` (block-floating-point, lifting, reordering,
negabinary) and :mod:`.fast1d` (the 1-D plane tables) are shared; the slow torch reference
the tests hold both coders to is ``tests/reference/zfp_bitplane.py``. :func:`backend` says
which coder runs.
"""

from __future__ import annotations

import math

import torch

from moeflow.comm.codecs.zfp.transform import blocks_per_array, maxbits_for, stream_bytes

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _as_float32(a, what: str) -> torch.Tensor:
    a = torch.as_tensor(a)
    if a.dtype not in FLOAT_DTYPES:
        raise ValueError(f"zfp.{what}: dtype {a.dtype} is not supported; ZFP here codes float32 "
                         "(float16/bfloat16/float64 are converted to float32); cast the array")
    return a.to(torch.float32).contiguous()


def _dims(a: torch.Tensor, dims: int | None, what: str) -> int:
    d = a.dim() if dims is None else dims
    if d not in (1, 2, 3):
        raise ValueError(f"zfp.{what}: dims={d!r} is invalid: ZFP blocks are 1-, 2- or "
                         "3-dimensional; pass dims=1, 2 or 3")
    if a.dim() < d:
        raise ValueError(f"zfp.{what}: a {a.dim()}-D array cannot be coded with dims={d}; "
                         "use dims <= a.dim()")
    if any(s == 0 for s in a.shape):
        raise ValueError(f"zfp.{what}: empty array of shape {tuple(a.shape)}")
    return d


def compress(a, rate: float = 8.0, dims: int | None = None) -> torch.Tensor:
    """Fixed-rate ZFP stream(s) of ``a``: uint8 ``(*lead, nbytes)`` on ``a``'s device.

    ``dims`` (default ``a.dim()``) trailing axes form each array; ``rate`` bits per value
    (``maxbits = floor(4^dims * rate + 0.5)`` bits per block, at least 9).
    """
    a = _as_float32(a, "compress")
    d = _dims(a, dims, "compress")
    mb = maxbits_for(rate, d)
    if _triton_for(a):                                   # CUDA: the Triton kernels
        from moeflow.comm.codecs.zfp import triton_backend, triton_nd
        if d == 1:
            rows = triton_backend.compress_rows(a.reshape(-1, a.shape[-1]), rate)
            return rows.reshape(*a.shape[:-1], rows.shape[-1])
        return triton_nd.compress(a, d, mb)
    from moeflow.comm.codecs.zfp import numba_backend    # CPU (other devices: a copy)
    return numba_backend.compress(a.cpu(), d, mb).to(a.device)


def _triton_for(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to the Triton kernels: a CUDA tensor, with triton installed."""
    if not t.is_cuda:
        return False
    from moeflow.comm.codecs.zfp import triton_nd
    return triton_nd.available()


def backend(device, dims: int) -> str:
    """Which coder ``compress``/``decompress`` run for ``dims``-D arrays on ``device``:
    ``"triton"`` (CUDA with triton) or ``"numba"`` (the CPU coder; tensors on other devices are
    copied to the CPU and back)."""
    return "triton" if _triton_for(torch.empty(0, device=device)) else "numba"


def decompress(data: torch.Tensor, shape, rate: float = 8.0, dims: int | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`compress`: the decoded array of ``shape`` (as zfpy decodes it)."""
    shape = tuple(int(s) for s in shape)
    d = len(shape) if dims is None else dims
    if d not in (1, 2, 3) or len(shape) < d:
        raise ValueError(f"zfp.decompress: dims={d!r} is invalid for shape {shape}; "
                         "use 1, 2 or 3 and at most len(shape)")
    mb = maxbits_for(rate, d)
    need = stream_bytes(blocks_per_array(shape, d), mb)
    data = torch.as_tensor(data)
    if data.dtype != torch.uint8 or data.shape[-1] != need:
        raise ValueError(f"zfp.decompress: expected uint8 streams of {need} bytes (last dim) "
                         f"for shape {shape}, rate {rate}, dims {d}; got {data.dtype} "
                         f"{tuple(data.shape)}")
    streams = math.prod(shape[: len(shape) - d])
    if data.numel() != streams * need:
        raise ValueError(f"zfp.decompress: shape {shape} with dims={d} is {streams} stream(s) of "
                         f"{need} bytes, but data {tuple(data.shape)} holds "
                         f"{data.numel() // need}; pass the shape the streams were made from")
    if _triton_for(data):                                # CUDA: the Triton kernels
        from moeflow.comm.codecs.zfp import triton_backend, triton_nd
        if d == 1:
            rows = data.reshape(-1, need)
            out = triton_backend.decompress_rows(rows, shape[-1], rate).reshape(shape)
        else:
            out = triton_nd.decompress(data, shape, d, mb)
    else:                                                # CPU (other devices: a copy)
        from moeflow.comm.codecs.zfp import numba_backend
        out = numba_backend.decompress(data.cpu(), shape, d, mb).to(data.device)
    return out.to(dtype)


def compressed_bytes(shape, rate: float = 8.0, dims: int | None = None) -> int:
    """Total bytes :func:`compress` returns for an array of ``shape``."""
    shape = tuple(shape)
    d = len(shape) if dims is None else dims
    mb = maxbits_for(rate, d)
    return math.prod(shape[: len(shape) - d]) * stream_bytes(blocks_per_array(shape, d), mb)


__all__ = ["compress", "decompress", "compressed_bytes", "maxbits_for", "backend"]
