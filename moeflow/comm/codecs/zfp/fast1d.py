"""Reference bit-plane coder for 1-D ZFP blocks (4 values) and the lookup tables built from it
(Lindstrom 2014, section 3.4, zfp's fixed-rate ``encode_ints`` / ``decode_ints``; the ZFP of
ScheMoE section 3.1): :func:`_enc_table` (n, ``G`` planes) -> code, length, new n, and
:func:`_dec_table` (n, bits left, next 8 stream bits) -> one decoded plane, zfp's behaviour at
the end of the budget included. They drive the Triton 1-D kernels and :mod:`.numba_planes`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


S = 4


# ------------------------------------------------------------------ reference plane coder


def _encode_plane(x: int, n: int) -> tuple[int, int, int]:
    """Untruncated code of one plane ``x`` (bit i = coefficient i) given ``n``: (code, len, n')."""
    out, ln = 0, 0

    def put(b):
        nonlocal out, ln
        out |= (b & 1) << ln
        ln += 1

    for i in range(n):
        put(x >> i)
    x >>= n
    while n < S:
        put(1 if x else 0)
        if not x:
            break
        while n < S - 1:
            b = x & 1
            put(b)
            if b:
                break
            x >>= 1
            n += 1
        x >>= 1
        n += 1
    return out, ln, n


def _decode_plane(stream: int, n: int, bits: int) -> tuple[int, int, int]:
    """zfp's decoder on one plane with ``bits`` budget left: (x, bits read, n')."""
    pos = 0

    def get():
        nonlocal pos
        b = (stream >> pos) & 1
        pos += 1
        return b

    m = min(n, bits)
    bits -= m
    x = 0
    for i in range(m):
        x |= get() << i
    while n < S and bits:
        bits -= 1
        if not get():
            break
        while n < S - 1 and bits:
            bits -= 1
            if get():
                break
            n += 1
        x |= 1 << n
        n += 1
    return x, pos, n


def _spread(x: int) -> int:
    """4-bit plane -> bits at 0, 16, 32, 48."""
    return sum(((x >> i) & 1) << (16 * i) for i in range(S))


@functools.lru_cache(maxsize=None)
def _enc_table(G: int) -> torch.Tensor:
    """Entry for (n, planes) = code | len << 40 | n' << 48, planes indexed as 4 G-bit fields
    (field i = coefficient i's bits of the G planes, most significant plane highest)."""
    one = [_encode_plane(x, n) for n in range(S + 1) for x in range(1 << S)]
    c1, l1, n1 = (np.array(v, dtype=np.int64) for v in zip(*one))
    idx = np.arange(1 << (S * G), dtype=np.int64)
    cols = []
    for n in range(S + 1):                                 # numpy: built once, off torch
        code = np.zeros_like(idx)
        ln = np.zeros_like(idx)
        nn = np.full_like(idx, n)
        for g in range(G - 1, -1, -1):                     # highest plane first
            x = sum((((idx >> (G * i)) >> g) & 1) << i for i in range(S))
            e = nn * (1 << S) + x
            code |= c1[e] << ln
            ln += l1[e]
            nn = n1[e]
        cols.append(code | (ln << 40) | (nn << 48))
    return torch.from_numpy(np.concatenate(cols))


@functools.lru_cache(maxsize=None)
def _dec_table() -> torch.Tensor:
    """Entry for (n, min(bits left, 8), next 8 bits) =
    spread(x) | len << 1 | n' << 5 | (n' * 9 * 256) << 49 (the next lookup's row offset)."""
    vals = []
    for n in range(S + 1):
        for r in range(9):
            for peek in range(256):
                x, ln, nn = _decode_plane(peek, n, r)
                vals.append(_spread(x) | (ln << 1) | (nn << 5) | ((nn * 9 * 256) << 49))
    return torch.tensor(vals, dtype=torch.int64)
