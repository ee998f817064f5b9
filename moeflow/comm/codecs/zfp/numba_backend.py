"""ZFP fixed-rate coding of CPU arrays by a compiled per-block coder (numba); any d, used for
2-D and 3-D blocks.

This is LLNL zfp's own algorithm, block by block, as its C code runs it (Lindstrom 2014,
"Fixed-rate compressed floating-point arrays"; the ZFP codec of ScheMoE section 3.1):

- header (section 3.1): one bit "block is nonzero", then the biased common exponent
  ``emax + 127`` in 8 bits; an all-zero block is the single bit 0;
- block-floating-point cast ``trunc(x * 2^(30 - emax))`` in float32 (section 3.1), the
  decorrelating lifting transform along x, y, z (section 3.2), the total-sequency reordering
  and negabinary mapping (section 3.3), exactly as :mod:`.transform` documents them (32-bit
  wrapping integers, zfp's rounding, inf/NaN as zfp's x86 code treats them);
- the embedded coder (section 3.4): bit planes from the top; the first ``n`` bits of a plane
  verbatim (``n`` = coefficients already significant), then group tests: a 1 bit if any
  remaining coefficient is significant, followed by 0s up to the next one-bit (unary run
  lengths), until exactly ``maxbits`` bits are written; the stream is zero padded to ``maxbits``.

Why compiled: vectorized torch runs one tensor op per step across all blocks. That reaches
zfpy's speed for 1-D blocks (the table coder of :mod:`.group_encode`, which stays the 1-D CPU
path: it measured faster than this coder there), but the 2-D/3-D plane coder
(:mod:`.plane_encode`, :mod:`.plane_decode`) measured 0.11-0.21x of zfpy's single C loop. So
CPU 2-D/3-D arrays use this coder when numba is installed; the torch coders remain for other
devices, for CPUs without numba, and as its cross-check (``tests/test_zfp_numba.py``).

Streams are zfp's: 64-bit little-endian words, LSB first, each slice's blocks back to back and
padded to a whole word. The coder is single-threaded (as zfpy is) and releases the GIL. Each
unary run costs one trailing-zero count (LLVM ``cttz``, numba's intrinsic); the decoder reads
the stream through a 64-bit window.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from moeflow.comm.codecs.zfp import transform as T

try:
    import numba
    from numba import njit
    from numba.cpython.unsafe.numbers import trailing_zeros   # LLVM cttz
except ImportError:                          # pragma: no cover - zfp then uses the torch coders
    numba = None

U64 = np.uint64
I64 = np.int64
NB = 0xAAAAAAAA
MASK32 = 0xFFFFFFFF


def available() -> bool:
    """Whether numba is installed (otherwise CPU tensors use the vectorized torch coders)."""
    return numba is not None


if numba is not None:
    _jit = njit(cache=True, nogil=True, boundscheck=False)

    @_jit
    def _w32(x):
        """Wrap an integer to int32 (zfp's ``Int`` arithmetic)."""
        return I64(np.int32(x))

    @_jit
    def _fwd_lift(p, o, s):
        """Section 3.2: zfp's forward lifting of p[o], p[o+s], p[o+2s], p[o+3s] (int32 wrap)."""
        x = I64(p[o]); y = I64(p[o + s]); z = I64(p[o + 2 * s]); w = I64(p[o + 3 * s])
        x = _w32(x + w); x >>= 1; w = _w32(w - x)
        z = _w32(z + y); z >>= 1; y = _w32(y - z)
        x = _w32(x + z); x >>= 1; z = _w32(z - x)
        w = _w32(w + y); w >>= 1; y = _w32(y - w)
        w = _w32(w + (y >> 1)); y = _w32(y - (w >> 1))
        p[o] = x; p[o + s] = y; p[o + 2 * s] = z; p[o + 3 * s] = w

    @_jit
    def _inv_lift(p, o, s):
        """Inverse of :func:`_fwd_lift` (zfp's ``inv_lift``)."""
        x = I64(p[o]); y = I64(p[o + s]); z = I64(p[o + 2 * s]); w = I64(p[o + 3 * s])
        y = _w32(y + (w >> 1)); w = _w32(w - (y >> 1))
        y = _w32(y + w); w = _w32(w << 1); w = _w32(w - y)
        z = _w32(z + x); x = _w32(x << 1); x = _w32(x - z)
        y = _w32(y + z); z = _w32(z << 1); z = _w32(z - y)
        w = _w32(w + x); x = _w32(x << 1); x = _w32(x - w)
        p[o] = x; p[o + s] = y; p[o + 2 * s] = z; p[o + 3 * s] = w

    @_jit
    def _xform(p, d, inverse):
        """Section 3.2: lift along x (stride 1), then y (stride 4), then z (stride 16); the
        inverse runs z, y, x."""
        if d == 1:
            if inverse:
                _inv_lift(p, 0, 1)
            else:
                _fwd_lift(p, 0, 1)
        elif d == 2:
            if inverse:
                for i in range(4):
                    _inv_lift(p, i, 4)
                for i in range(4):
                    _inv_lift(p, 4 * i, 1)
            else:
                for i in range(4):
                    _fwd_lift(p, 4 * i, 1)
                for i in range(4):
                    _fwd_lift(p, i, 4)
        elif inverse:
            for i in range(16):
                _inv_lift(p, i, 16)
            for i in range(4):
                for j in range(4):
                    _inv_lift(p, 16 * i + j, 4)
            for i in range(16):
                _inv_lift(p, 4 * i, 1)
        else:
            for i in range(16):
                _fwd_lift(p, 4 * i, 1)
            for i in range(4):
                for j in range(4):
                    _fwd_lift(p, 16 * i + j, 4)
            for i in range(16):
                _fwd_lift(p, i, 16)

    @_jit
    def _pow2(e):
        """float32 ``2^e`` as ``ldexpf(1, e)`` gives it (0 below 2^-149, inf above 2^127)."""
        if -126 <= e <= 127:
            return np.int32((e + 127) << 23).view(np.float32)
        return np.float32(math.ldexp(1.0, e))

    @_jit
    def _emax(bits, r):
        """Exponent of block ``r`` (float32 bit patterns ``bits``) as
        :func:`.transform.block_emax` computes it (NaN skipped; -127 for an all-zero block; 0
        for an infinite maximum)."""
        amax = 0
        for i in range(bits.shape[1]):                    # branch-free, so it vectorizes
            a = I64(bits[r, i]) & 0x7FFFFFFF
            amax = max(amax, a if a <= 0x7F800000 else 0)  # NaN (above inf's bits) skipped
        if amax == 0:
            return -127
        be = amax >> 23
        if be == 0xFF:
            return 0
        return max(be - 126, -126)

    @_jit
    def _put(words, pos, v, n):
        """Or the ``n``-bit value ``v`` (uint64) into zeroed ``words`` at bit ``pos``."""
        if n == 0:
            return
        w = pos >> 6
        sh = pos & 63
        words[w] |= v << U64(sh)
        if sh + n > 64:
            words[w + 1] |= v >> U64(64 - sh)

    @_jit
    def _set(words, pos):
        """Set bit ``pos`` of ``words``."""
        words[pos >> 6] |= U64(1) << U64(pos & 63)

    @_jit
    def _window(words, p):
        """The 64 stream bits from bit ``p`` (zeros past the end of ``words``)."""
        w = p >> 6
        sh = p & 63
        v = words[w] >> U64(sh)
        if sh and w + 1 < words.shape[0]:
            v |= words[w + 1] << U64(64 - sh)
        return v

    @_jit
    def _decode_planes(words, p, S, bits, u):
        """Section 3.4, zfp's ``decode_ints`` with ``maxprec = 32``: negabinary ``u`` from the
        ``bits``-bit plane code at bit ``p``. The stream is read through a 64-bit window
        (``buf``, of which ``c`` bits are used); a unary run is one trailing-zero count over
        the bits it may take. As in zfp, a run cut by the budget still sets its last position."""
        for i in range(S):
            u[i] = 0
        buf = _window(words, p)
        c = 0
        n = 0
        k = 32
        while bits > 0 and k > 0:
            k -= 1
            m = min(n, bits)
            x = U64(0)
            if m > 0:
                if c + m > 64:
                    p += c
                    buf = _window(words, p)
                    c = 0
                x = buf >> U64(c)
                if m < 64:
                    x &= (U64(1) << U64(m)) - U64(1)
                c += m
                bits -= m
            while n < S and bits > 0:                     # group test, then its unary run
                L = min(S - 1 - n, bits - 1)              # bits the run may take
                if c + L + 1 > 64:
                    p += c
                    buf = _window(words, p)
                    c = 0
                w = buf >> U64(c)
                c += 1
                bits -= 1
                if w & U64(1) == 0:
                    break
                t = I64(trailing_zeros(w >> U64(1)))      # first one-bit of the run
                if t < L:
                    c += t + 1
                    bits -= t + 1
                    n += t
                else:
                    c += L
                    bits -= L
                    n += L
                x += U64(1) << U64(n)
                n += 1
            for i in range(S):                            # deposit plane k (branch-free)
                u[i] |= I64((x >> U64(i)) & U64(1)) << k

    @_jit
    def _encode_block(blocks, bits, r, d, perm, maxbits, words, pos, ib, u):
        """Code float32 block ``r`` (``bits``: its bit patterns) into ``words`` at bit ``pos``
        (``ib``, ``u``: scratch)."""
        S = 4 ** d
        emax = _emax(bits, r)
        e = emax + 127
        if e == 0:                                        # all zero: one 0 bit, then padding
            return
        _put(words, pos, U64(2 * e + 1), 9)
        s = _pow2(30 - emax)
        for i in range(S):
            y = blocks[r, i] * s
            ib[i] = np.int32(y) if abs(y) < 2147483648.0 else -2147483648   # cvttss2si
        _xform(ib, d, False)
        for i in range(S):                                # section 3.3: order + negabinary
            u[i] = ((I64(ib[perm[i]]) + NB) & MASK32) ^ NB
        _encode_planes(u, S, maxbits - 9, words, pos + 9)

    @_jit
    def _encode_planes(u, S, bits, words, p):
        """Section 3.4, zfp's ``encode_ints`` with ``maxprec = 32``: the planes of the negabinary
        coefficients ``u`` (sequency order) from the top, ``bits`` bits from bit ``p``. Each
        group test costs one trailing-zero count: its code is ``1``, the zeros up to the next
        one-bit, then that ``1`` (left out at the last position, where it is implied)."""
        n = 0
        k = 32
        while bits > 0 and k > 0:
            k -= 1
            x = U64(0)
            for i in range(S):
                x |= U64((u[i] >> k) & 1) << U64(i)
            m = min(n, bits)                              # the first n bits verbatim
            if m > 0:
                _put(words, p, x & ((U64(1) << U64(m)) - U64(1)) if m < 64 else x, m)
                p += m
                bits -= m
                x = x >> U64(m) if m < 64 else U64(0)
            while n < S and bits > 0:                     # group test: any one-bit left?
                bits -= 1
                if x == 0:
                    p += 1                                # a 0 bit (words start zeroed)
                    break
                _set(words, p)
                p += 1
                t = I64(trailing_zeros(x))                # zeros before the next one-bit
                L = min(S - 1 - n, bits)                  # bits the unary run may take
                if t < L:                                 # t zeros, then the one-bit
                    p += t
                    _set(words, p)
                    p += 1
                    bits -= t + 1
                    x >>= U64(t + 1)
                    n += t + 1
                else:                                     # run cut by the budget or implied
                    p += L
                    bits -= L
                    x = (x >> U64(L)) >> U64(1)
                    n += L + 1

    @_jit
    def _decode_block(words, pos, d, perm, maxbits, out, ib, u):
        """Decode the block at bit ``pos`` into float32 ``out`` (``ib``, ``u``: scratch)."""
        S = 4 ** d
        head = _window(words, pos)
        if head & U64(1) == 0:
            for i in range(S):
                out[i] = 0.0
            return
        emax = I64((head >> U64(1)) & U64(0xFF)) - 127
        _decode_planes(words, pos + 9, S, maxbits - 9, u)
        for i in range(S):                                # undo negabinary + reorder
            ib[perm[i]] = np.int32(((u[i] & MASK32) ^ NB) - NB)
        _xform(ib, d, True)
        s = _pow2(emax - 30)
        for i in range(S):
            out[i] = np.float32(ib[i]) * s

    @_jit
    def _encode(blocks, d, perm, maxbits, per, nws):
        """float32 ``(nslices * per, 4^d)`` -> uint64 words ``(nslices, nws)``."""
        S = 4 ** d
        words = np.zeros((blocks.shape[0] // per, nws), dtype=np.uint64)
        bits = blocks.view(np.int32)
        ib = np.empty(S, dtype=np.int32)
        u = np.empty(S, dtype=np.int64)
        for r in range(blocks.shape[0]):
            _encode_block(blocks, bits, r, d, perm, maxbits, words[r // per],
                          (r % per) * maxbits, ib, u)
        return words

    @_jit
    def _decode(words, d, perm, maxbits, per):
        """uint64 words ``(nslices, nws)`` -> float32 ``(nslices * per, 4^d)``."""
        S = 4 ** d
        out = np.empty((words.shape[0] * per, S), dtype=np.float32)
        ib = np.empty(S, dtype=np.int32)
        u = np.empty(S, dtype=np.int64)
        for r in range(out.shape[0]):
            _decode_block(words[r // per], (r % per) * maxbits, d, perm, maxbits, out[r], ib, u)
        return out


def compress(a: torch.Tensor, d: int, maxbits: int) -> torch.Tensor:
    """float32 CPU array; its last ``d`` dims form one zfp array per leading index -> uint8
    ``(*lead, nbytes)``: each slice's own zfp stream (``torch_backend.compress``'s bytes)."""
    _require()
    lead = a.shape[: a.dim() - d]
    blocks = T.to_blocks(a.detach(), d).contiguous()
    per = T.blocks_per_array(a.shape, d)
    nws = -(-per * maxbits // 64)
    words = _encode(blocks.numpy(), d, _perm(d), maxbits, per, nws)
    return torch.from_numpy(words).view(torch.uint8).reshape(*lead, nws * 8)


def decompress(data: torch.Tensor, shape: tuple[int, ...], d: int, maxbits: int) -> torch.Tensor:
    """Inverse of :func:`compress`: uint8 streams -> float32 array of ``shape``."""
    _require()
    per = T.blocks_per_array(shape, d)
    nbytes = data.shape[-1]
    rows = data.reshape(-1, nbytes).contiguous()
    if rows.storage_offset() % 8:                         # uint64 view needs 8-byte alignment
        rows = rows.clone()
    blocks = _decode(rows.numpy().view(np.uint64), d, _perm(d), maxbits, per)
    return T.from_blocks(torch.from_numpy(blocks), tuple(shape), d)


@functools.lru_cache(maxsize=None)
def _perm(d: int) -> np.ndarray:
    return np.asarray(T.PERM[d], dtype=np.int64)


def _require() -> None:
    if numba is None:
        raise RuntimeError("zfp.numba_backend needs numba (pip install 'numba>=0.59'); "
                           "zfp.compress/decompress fall back to the torch coders without it")


__all__ = ["available", "compress", "decompress"]
