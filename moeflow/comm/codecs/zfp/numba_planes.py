"""The embedded bit-plane coder of zfp's fixed-rate mode (Lindstrom 2014, section 3.4; zfp's
``encode_ints`` / ``decode_ints`` with ``maxprec = 32``), compiled by numba for
:mod:`.numba_backend`, with the bit I/O on zfp's stream (64-bit little-endian words, LSB first).

Two forms, the same bits: :func:`encode_planes` / :func:`decode_planes` for any block size, one
trailing-zero count per unary run; :func:`encode_planes_1d` / :func:`decode_planes_1d` for
4-value blocks by table lookups built from :mod:`.fast1d` (``ENC_GROUP`` planes per encoder
lookup; up to ``DEC_PLANES`` planes per decoder lookup of the next 8 stream bits, zfp's
behaviour at the end of the budget built into the table).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros   # LLVM cttz

from moeflow.comm.codecs.zfp import fast1d
from moeflow.comm.codecs.zfp.numba_simd import deposit_plane, plane_bits

U64 = np.uint64
I64 = np.int64
ENC_GROUP = 2                     # planes per encoder table lookup (5 x 2^8 entries: L1-sized)
DEC_PLANES = 4                    # at most this many planes per decoder lookup
# Everything here is inlined into its callers by numba (``inline="always"``): calls between
# numba functions are not inlined by LLVM, and a call per plane or per block costs more than
# the work it does.
_inline = njit(nogil=True, boundscheck=False, inline="always")


@functools.lru_cache(maxsize=None)
def tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 1-D coder's tables as uint64 arrays: the encoder's (:func:`.fast1d._enc_table`,
    ``ENC_GROUP`` planes per entry) and the decoder's two, both indexed by
    ``(n * 9 + min(bits left, 8)) << 8 | next 8 stream bits``: one plane per entry, and up to
    ``DEC_PLANES`` planes per entry. A decoder entry holds coefficient ``i``'s bits of its
    planes at bits ``4 i`` (first plane highest), the bits taken at 16, the number of planes
    at 24 and the new ``n`` at 28."""
    one = fast1d._dec_table().numpy()                 # spread(x) | len << 1 | n' << 5 | ...
    x = sum(((one >> (16 * i)) & 1) << (4 * i) for i in range(4))
    single = x | (((one >> 1) & 15) << 16) | (1 << 24) | (((one >> 5) & 7) << 28)
    return (fast1d._enc_table(ENC_GROUP).numpy().astype(np.uint64), single.astype(np.uint64),
            _many_planes(one).astype(np.uint64))


def _many_planes(one: np.ndarray) -> np.ndarray:
    """The many-plane decoder table, built by running the one-plane table (zfp's
    ``decode_ints`` on one plane, :func:`.fast1d._decode_plane`) plane after plane. With 8 or
    more bits left, an entry holds the planes whose codes end inside the 8 peeked bits (the
    decoder read exactly those bits, so the unseen ones did not matter); with ``r < 8`` bits
    left, it holds what zfp decodes from the ``r`` bits, the last plane cut where the budget
    ends. At most ``DEC_PLANES`` planes either way."""
    idx = np.arange(5 * 9 * 256, dtype=np.int64)
    n = idx // (9 * 256)
    r = (idx >> 8) % 9
    peek = idx & 0xFF
    used = np.zeros_like(idx)
    planes = np.zeros_like(idx)
    fields = np.zeros_like(idx)
    going = r > 0
    for _ in range(DEC_PLANES):
        left = np.where(r == 8, 8, r - used)                # budget the plane is decoded with
        e = one[((n * 9 + np.maximum(left, 0)) << 8) + ((peek >> used) & 0xFF)]
        taken = (e >> 1) & 15
        going &= (left > 0) & (used + taken <= 8)
        x = sum(((e >> (16 * i)) & 1) << (4 * i) for i in range(4))
        fields = np.where(going, (fields << 1) | x, fields)
        used = np.where(going, used + taken, used)
        n = np.where(going, (e >> 5) & 7, n)
        planes += going
    assert planes[r > 0].min() >= 1, "every plane code fits in 8 bits"
    return fields | (used << 16) | (planes << 24) | (n << 28)


@_inline
def put(words, pos, v, n):
    """Or the ``n``-bit value ``v`` (uint64) into zeroed ``words`` at bit ``pos``."""
    if n == 0:
        return
    w = pos >> 6
    sh = pos & 63
    words[w] |= v << U64(sh)
    if sh + n > 64:
        words[w + 1] |= v >> U64(64 - sh)


@_inline
def set_bit(words, pos):
    """Set bit ``pos`` of ``words``."""
    words[pos >> 6] |= U64(1) << U64(pos & 63)


@_inline
def window(words, p):
    """The 64 stream bits from bit ``p`` (zeros past the end of ``words``)."""
    w = p >> 6
    sh = p & 63
    v = words[w] >> U64(sh)
    if sh and w + 1 < words.shape[0]:
        v |= words[w + 1] << U64(64 - sh)
    return v


@_inline
def decode_planes(words, p, S, bits, u):
    """Section 3.4, zfp's ``decode_ints`` with ``maxprec = 32``: negabinary ``u`` from the
    ``bits``-bit plane code at bit ``p``. The stream is read through a 64-bit window
    (``buf``, of which ``c`` bits are used); a unary run is one trailing-zero count over
    the bits it may take. As in zfp, a run cut by the budget still sets its last position."""
    for i in range(S):
        u[i] = 0
    buf = window(words, p)
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
                buf = window(words, p)
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
                buf = window(words, p)
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
        deposit_plane(u, x, k, S)


@_inline
def encode_planes(u, S, bits, words, p):
    """Section 3.4, zfp's ``encode_ints`` with ``maxprec = 32``: the planes of the negabinary
    coefficients ``u`` (sequency order) from the top, ``bits`` bits from bit ``p``. Each
    group test costs one trailing-zero count: its code is ``1``, the zeros up to the next
    one-bit, then that ``1`` (left out at the last position, where it is implied)."""
    n = 0
    k = 32
    while bits > 0 and k > 0:
        k -= 1
        x = plane_bits(u, k, S)
        m = min(n, bits)                              # the first n bits verbatim
        if m > 0:
            put(words, p, x & ((U64(1) << U64(m)) - U64(1)) if m < 64 else x, m)
            p += m
            bits -= m
            x = x >> U64(m) if m < 64 else U64(0)
        while n < S and bits > 0:                     # group test: any one-bit left?
            bits -= 1
            if x == 0:
                p += 1                                # a 0 bit (words start zeroed)
                break
            set_bit(words, p)
            p += 1
            t = I64(trailing_zeros(x))                # zeros before the next one-bit
            L = min(S - 1 - n, bits)                  # bits the unary run may take
            if t < L:                                 # t zeros, then the one-bit
                p += t
                set_bit(words, p)
                p += 1
                bits -= t + 1
                x >>= U64(t + 1)
                n += t + 1
            else:                                     # run cut by the budget or implied
                p += L
                bits -= L
                x = (x >> U64(L)) >> U64(1)
                n += L + 1


@_inline
def encode_planes_1d(u, bits, words, p, table):
    """:func:`encode_planes` for a 4-value block by table: ``ENC_GROUP`` planes per lookup of
    (``n``, the planes' bits) -> (code, length, new ``n``); the last code is cut at the budget."""
    n = 0
    k = 32
    while bits > 0 and k > 0:
        k -= ENC_GROUP
        idx = I64(0)                                      # field i: coefficient i's planes
        for i in range(4):
            idx |= I64((u[i] >> k) & ((1 << ENC_GROUP) - 1)) << (ENC_GROUP * i)
        e = table[(n << (4 * ENC_GROUP)) + idx]
        m = min(I64((e >> U64(40)) & U64(0xFF)), bits)
        put(words, p, e & ((U64(1) << U64(m)) - U64(1)), m)
        n = I64(e >> U64(48))
        p += m
        bits -= m


@_inline
def decode_planes_1d(words, p, c, bits, single, many):
    """:func:`decode_planes` for a 4-value block by table, from bit ``p + c`` (``c < 56``): each
    lookup of (``n``, min(bits left, 8), the next 8 stream bits) decodes up to ``DEC_PLANES``
    planes (one plane when fewer planes are left). Returns the coefficients as two uint64 words
    (0 and 1, then 2 and 3, low half first), which :func:`.numba_simd.inv_block_1d` takes in
    registers."""
    buf = window(words, p)
    n = 0
    k = 32
    lo = U64(0)                                           # coefficients 0 and 1
    hi = U64(0)                                           # coefficients 2 and 3
    while bits > 0 and k > 0:
        if c > 56:                                        # keep 8 unread bits in view
            p += c
            buf = window(words, p)
            c = 0
        i = ((n * 9 + min(bits, 8)) << 8) + I64((buf >> U64(c)) & U64(0xFF))
        e = many[i] if k >= DEC_PLANES else single[i]
        k -= I64((e >> U64(24)) & U64(7))
        lo |= ((e & U64(0xF)) | ((e & U64(0xF0)) << U64(28))) << U64(k)
        hi |= (((e >> U64(8)) & U64(0xF)) | ((e & U64(0xF000)) << U64(20))) << U64(k)
        taken = I64((e >> U64(16)) & U64(15))
        n = I64((e >> U64(28)) & U64(7))
        c += taken
        bits -= taken
    return lo, hi


__all__ = ["decode_planes", "decode_planes_1d", "encode_planes", "encode_planes_1d", "put",
           "set_bit", "tables", "window"]
