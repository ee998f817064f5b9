"""Triton device functions shared by the ZFP kernels of :mod:`.triton_backend` (1-D rows) and
:mod:`.triton_nd` (2-D / 3-D blocks, long 1-D blocks): zfp's lifting transform and its
inverse (Lindstrom 2014, section 3.2), the float -> int cast, negabinary (section 3.3), and
64-bit reads / atomic writes of the bit stream (section 3.4). Below both kernel modules, so
neither imports the other for them.
"""

from __future__ import annotations

try:                                                     # optional dependency (extra "gpu")
    import triton
    import triton.language as tl
except ImportError:                                      # pragma: no cover
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _fwd_lift(x, y, z, w):
        # zfp's fwd_lift (section 3.2), wrapping 32-bit arithmetic
        x += w; x = x >> 1; w -= x
        z += y; z = z >> 1; y -= z
        x += z; x = x >> 1; z -= x
        w += y; w = w >> 1; y -= w
        w += y >> 1; y -= w >> 1
        return x, y, z, w

    @triton.jit
    def _inv_lift(x, y, z, w):
        # zfp's inv_lift: the inverse of _fwd_lift
        y += w >> 1; w -= y >> 1
        y += w; w = w << 1; w -= y
        z += x; x = x << 1; x -= z
        y += z; z = z << 1; z -= y
        w += x; x = x << 1; x -= w
        return x, y, z, w

    @triton.jit
    def _to_int(y):
        # trunc(y), or INT_MIN where y is not finite or not below 2^31 (x86 cvttss2si, as zfp)
        ok = tl.abs(y) < 2147483648.0
        return tl.where(ok, tl.where(ok, y, 0.0).to(tl.int32), -2147483648)

    @triton.jit
    def _negabinary(v):
        return ((v.to(tl.int64) + 0xAAAAAAAA) & 0xFFFFFFFF) ^ 0xAAAAAAAA

    @triton.jit
    def _get64(ptr, off, nwords, mask):
        # the 64 stream bits starting at bit `off` (int32 words, LSB first; 0 past the end)
        w = off >> 5
        sh = off & 31
        w0 = tl.load(ptr + w, mask=mask & (w < nwords), other=0).to(tl.int64) & 0xFFFFFFFF
        w1 = tl.load(ptr + w + 1, mask=mask & (w + 1 < nwords), other=0).to(tl.int64)
        w2 = tl.load(ptr + w + 2, mask=mask & (w + 2 < nwords), other=0).to(tl.int64)
        w1 = w1 & 0xFFFFFFFF
        w2 = w2 & 0xFFFFFFFF
        lo = ((w0 >> sh) | (w1 << (32 - sh))) & 0xFFFFFFFF
        hi = ((w1 >> sh) | (w2 << (32 - sh))) & 0xFFFFFFFF
        return lo | (hi << 32)

    @triton.jit
    def _put64(ptr, off, v, mask):
        # or the 64-bit pattern v into the stream at bit `off` (three 32-bit atomics; blocks
        # that share a word write disjoint bits, so the result does not depend on the order)
        w = off >> 5
        sh = off & 31
        lo = v & 0xFFFFFFFF
        hi = (v >> 32) & 0xFFFFFFFF
        p0 = (lo << sh) & 0xFFFFFFFF
        p1 = ((lo << sh) >> 32) | ((hi << sh) & 0xFFFFFFFF)
        p2 = (hi << sh) >> 32
        tl.atomic_or(ptr + w, p0.to(tl.int32), mask=mask & (p0 != 0))
        tl.atomic_or(ptr + w + 1, p1.to(tl.int32), mask=mask & (p1 != 0))
        tl.atomic_or(ptr + w + 2, p2.to(tl.int32), mask=mask & (p2 != 0))
