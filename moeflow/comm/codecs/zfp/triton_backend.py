"""Triton kernels for ZFP fixed-rate coding of 1-D rows on CUDA (the ``zfp`` codec's GPU path;
Lindstrom 2014, sections 3.1-3.4, as :mod:`.transform` and :mod:`.fast1d`; ScheMoE section 3.1).
One lane owns one block of 4 values: exponent, cast, lifting, negabinary, then the 32 planes
coded with :mod:`.fast1d`'s (n, plane) table into a 64-bit register, or-ed into the row's stream
with 32-bit atomics; decoding mirrors it with the (n, bits left, next 8 bits) table. Blocks
above 64 bits go to :mod:`.triton_nd` (``d = 1``). Tested under ``TRITON_INTERPRET=1``
(``tests/unit/zfp/test_zfp_triton.py``).
"""

from __future__ import annotations

import functools

import torch

from moeflow.comm.codecs.zfp import fast1d, triton_nd
from moeflow.comm.codecs.zfp.transform import maxbits_for, stream_bytes

try:                                                     # optional dependency (extra "gpu")
    import triton
    import triton.language as tl
except ImportError:                                      # pragma: no cover
    triton = None
    tl = None

BLOCKS = 128


def available() -> bool:
    """Whether the Triton kernels can run (triton importable)."""
    return triton is not None


if triton is not None:

    from moeflow.comm.codecs.zfp.triton_common import (_fwd_lift, _get64, _inv_lift,
                                                       _negabinary, _put64, _to_int)

    @triton.jit
    def _encode_kernel(x_ptr, out_ptr, table_ptr, rows, cols, nblk, row_words,
                       MAXBITS: tl.constexpr, BLOCKS: tl.constexpr):
        pid = tl.program_id(0)
        b = pid * BLOCKS + tl.arange(0, BLOCKS)
        live = b < rows * nblk
        r = b // nblk
        j = b % nblk
        m = cols - 4 * j                                  # values of this block in the row
        base = x_ptr + r.to(tl.int64) * cols + 4 * j
        o1 = tl.where(m > 1, 1, 0)
        o2 = tl.where(m > 2, 2, tl.where(m == 2, 1, 0))
        o3 = tl.where(m > 3, 3, 0)
        f0 = tl.load(base, mask=live, other=0.0)
        f1 = tl.load(base + o1, mask=live, other=0.0)
        f2 = tl.load(base + o2, mask=live, other=0.0)
        f3 = tl.load(base + o3, mask=live, other=0.0)
        a0 = tl.where(f0 != f0, 0.0, tl.abs(f0))
        a1 = tl.where(f1 != f1, 0.0, tl.abs(f1))
        a2 = tl.where(f2 != f2, 0.0, tl.abs(f2))
        a3 = tl.where(f3 != f3, 0.0, tl.abs(f3))
        amax = tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3))
        be = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        emax = tl.maximum(be - 126, -126)
        emax = tl.where(amax == 0.0, -127, emax)
        emax = tl.where(be == 0xFF, 0, emax)
        e = emax + 127
        nonzero = e != 0
        # s = 2^(30 - emax) in float32 (inf when 30 - emax > 127, as ldexpf gives)
        es = 30 - emax
        s = tl.where(es > 127, float("inf"),
                     ((tl.minimum(es, 127) + 127) << 23).to(tl.float32, bitcast=True))
        y0 = f0 * s
        y1 = f1 * s
        y2 = f2 * s
        y3 = f3 * s
        i0 = _to_int(y0)
        i1 = _to_int(y1)
        i2 = _to_int(y2)
        i3 = _to_int(y3)
        i0, i1, i2, i3 = _fwd_lift(i0, i1, i2, i3)
        u0 = _negabinary(i0)
        u1 = _negabinary(i1)
        u2 = _negabinary(i2)
        u3 = _negabinary(i3)
        acc = tl.where(nonzero, 2 * e.to(tl.int64) + 1, 0)
        BUDGET: tl.constexpr = MAXBITS - 9
        pos = tl.zeros([BLOCKS], dtype=tl.int64)
        n = tl.zeros([BLOCKS], dtype=tl.int64)
        for kk in tl.static_range(32):
            k = 31 - kk
            x = ((u0 >> k) & 1) | (((u1 >> k) & 1) << 1) | (((u2 >> k) & 1) << 2) | \
                (((u3 >> k) & 1) << 3)
            ent = tl.load(table_ptr + n * 16 + x)
            left = tl.minimum(tl.maximum(BUDGET - pos, 0), 40)
            code = ent & ((tl.full([BLOCKS], 1, tl.int64) << left) - 1) & 0xFFFFFFFFFF
            acc = acc | (code << (tl.minimum(pos, BUDGET) + 9))
            pos += (ent >> 40) & 0xFF
            n = (ent >> 48) & 0xFF
        acc = tl.where(nonzero, acc, 0)
        # or the block's bits into the row stream (32-bit words) at its bit offset
        start = r.to(tl.int64) * (row_words * 32) + j.to(tl.int64) * MAXBITS
        _put64(out_ptr, start, acc, live)

    @triton.jit
    def _decode_kernel(in_ptr, x_ptr, table_ptr, rows, cols, nblk, row_words,
                       MAXBITS: tl.constexpr, BLOCKS: tl.constexpr):
        pid = tl.program_id(0)
        b = pid * BLOCKS + tl.arange(0, BLOCKS)
        live = b < rows * nblk
        r = b // nblk
        j = b % nblk
        start = r.to(tl.int64) * (row_words * 32) + j.to(tl.int64) * MAXBITS
        v = _get64(in_ptr, start, rows * row_words, live)     # the block's (first) 64 bits
        lo = v & 0xFFFFFFFF
        hi = (v >> 32) & 0xFFFFFFFF
        if MAXBITS < 32:
            lo = lo & ((1 << MAXBITS) - 1)
            hi = hi * 0
        elif MAXBITS < 64:
            hi = hi & ((1 << (MAXBITS - 32)) - 1)
        nonzero = (lo & 1) != 0
        emax = ((lo >> 1) & 0xFF).to(tl.int32) - 127
        body = (lo >> 9) | (hi << 23)
        BUDGET: tl.constexpr = MAXBITS - 9
        pos = tl.zeros([BLOCKS], dtype=tl.int64)
        n = tl.zeros([BLOCKS], dtype=tl.int64)
        ulo = tl.zeros([BLOCKS], dtype=tl.int64)
        uhi = tl.zeros([BLOCKS], dtype=tl.int64)
        for kk in tl.static_range(32):
            k = 31 - kk
            left = tl.minimum(tl.maximum(BUDGET - pos, 0), 8)
            peek = (body >> tl.minimum(pos, 63)) & 0xFF
            ent = tl.load(table_ptr + (n * 9 + left) * 256 + peek)
            x = ent & 0x0001000100010001
            if k >= 16:
                uhi = uhi | (x << (k - 16))
            else:
                ulo = ulo | (x << k)
            pos += (ent >> 1) & 15
            n = (ent >> 5) & 7
        u0 = (ulo & 0xFFFF) | ((uhi & 0xFFFF) << 16)
        u1 = ((ulo >> 16) & 0xFFFF) | (((uhi >> 16) & 0xFFFF) << 16)
        u2 = ((ulo >> 32) & 0xFFFF) | (((uhi >> 32) & 0xFFFF) << 16)
        u3 = ((ulo >> 48) & 0xFFFF) | (((uhi >> 48) & 0xFFFF) << 16)
        i0 = ((u0 ^ 0xAAAAAAAA) - 0xAAAAAAAA).to(tl.int32)
        i1 = ((u1 ^ 0xAAAAAAAA) - 0xAAAAAAAA).to(tl.int32)
        i2 = ((u2 ^ 0xAAAAAAAA) - 0xAAAAAAAA).to(tl.int32)
        i3 = ((u3 ^ 0xAAAAAAAA) - 0xAAAAAAAA).to(tl.int32)
        i0, i1, i2, i3 = _inv_lift(i0, i1, i2, i3)
        # s = 2^(emax - 30) in float32: normal, subnormal, or 0 as ldexpf rounds it
        es = emax - 30
        s_norm = ((tl.maximum(es, -126) + 127) << 23).to(tl.float32, bitcast=True)
        s_sub = (tl.full([BLOCKS], 1, tl.int32) << tl.minimum(tl.maximum(es + 149, 0), 22))
        s_sub = tl.where(es >= -149, s_sub, 0).to(tl.float32, bitcast=True)
        s = tl.where(es >= -126, s_norm, s_sub)
        g0 = tl.where(nonzero, i0.to(tl.float32) * s, 0.0)
        g1 = tl.where(nonzero, i1.to(tl.float32) * s, 0.0)
        g2 = tl.where(nonzero, i2.to(tl.float32) * s, 0.0)
        g3 = tl.where(nonzero, i3.to(tl.float32) * s, 0.0)
        base = x_ptr + r.to(tl.int64) * cols + 4 * j
        m = cols - 4 * j
        tl.store(base, g0, mask=live)
        tl.store(base + 1, g1, mask=live & (m > 1))
        tl.store(base + 2, g2, mask=live & (m > 2))
        tl.store(base + 3, g3, mask=live & (m > 3))


@functools.lru_cache(maxsize=None)
def _tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return fast1d._enc_table(1).to(device), fast1d._dec_table().to(device)


def compress_rows(x: torch.Tensor, rate: float) -> torch.Tensor:
    """float32 ``(rows, cols)`` on CUDA -> uint8 ``(rows, nbytes)``: each row's zfp stream,
    byte-identical to ``moeflow.comm.codecs.zfp.compress(x, rate, dims=1)``."""
    rows, cols = x.shape
    mb = maxbits_for(rate, 1)
    nblk = -(-cols // 4)
    nbytes = stream_bytes(nblk, mb)
    if mb > 64:
        return triton_nd.compress(x, 1, mb)
    out = torch.zeros(rows * nbytes // 4, dtype=torch.int32, device=x.device)
    enc, _ = _tables(str(x.device))
    grid = (triton.cdiv(rows * nblk, BLOCKS),)
    _encode_kernel[grid](x, out, enc, rows, cols, nblk, nbytes // 4, MAXBITS=mb, BLOCKS=BLOCKS)
    return out.view(torch.uint8).reshape(rows, nbytes)


def decompress_rows(data: torch.Tensor, cols: int, rate: float) -> torch.Tensor:
    """Inverse of :func:`compress_rows`: float32 ``(rows, cols)``."""
    rows, nbytes = data.shape
    mb = maxbits_for(rate, 1)
    if mb > 64:
        return triton_nd.decompress(data, (rows, cols), 1, mb)
    nblk = -(-cols // 4)
    out = torch.empty(rows, cols, dtype=torch.float32, device=data.device)
    _, dec = _tables(str(data.device))
    words = data.contiguous().view(torch.int32).reshape(-1)
    grid = (triton.cdiv(rows * nblk, BLOCKS),)
    _decode_kernel[grid](words, out, dec, rows, cols, nblk, nbytes // 4, MAXBITS=mb,
                         BLOCKS=BLOCKS)
    return out
