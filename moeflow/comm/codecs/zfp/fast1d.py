"""Table-driven ZFP coder for 1-D blocks (4 values), vectorized over blocks: the plane coder's
reference tables, the bit I/O, and the general 1-D path for rates above 16.

Same code as :mod:`bitplane` (Lindstrom 2014 section 3.4, zfp's fixed-rate mode), organised so
each step is a few whole-tensor ops: the 4 coefficients of a block are held "transposed" in two
int64 words (the low / high 16 bits of coefficient i at bits ``16 i``), so that ``G`` bit planes
of all four coefficients are pulled out with one shift, one mask and one multiply; a
precomputed table (:func:`_enc_table`) maps (number of significant coefficients ``n``, those
``4 G`` bits) to the planes' code, its length and the new ``n``. Decoding reads 8 stream bits
per plane through a table indexed by ``n``, the bits left in the block's budget (0..8) and those
8 bits (:func:`_dec_table`), which reproduces zfp's decoder exactly, including at the end of
the budget. Above ``maxbits = 64`` (:func:`encode`, :func:`decode`) codes are added into a flat
stream of 32-bit words at disjoint bit ranges. Up to 64 bits a block's whole code lives in one
int64: :mod:`.group_encode` and :mod:`.window_decode` are the fast paths there, and
:func:`decode_words_by_plane` is their reference. The Triton kernels use the same tables.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from moeflow.comm.codecs.zfp import transform as T

S = 4
_M1 = 0x0001000100010001          # bit 0 of each 16-bit field


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


# -------------------------------------------------------------------------- bit I/O


def _read(words: torch.Tensor, start: torch.Tensor, nbits: int) -> torch.Tensor:
    """``nbits <= 32`` stream bits starting at bit ``start`` (int64 per block)."""
    w = start >> 5
    v = words.index_select(0, w) | (words.index_select(0, w + 1) << 32)
    return (v >> (start & 31)) & ((1 << nbits) - 1)


def _write(words: torch.Tensor, start: torch.Tensor, code: torch.Tensor) -> None:
    """Add ``code`` (< 2^32, zero where nothing is written) at bit ``start``."""
    w = start >> 5
    v = code << (start & 31)
    words.index_add_(0, w, v & 0xFFFFFFFF)
    words.index_add_(0, w + 1, v >> 32)


# -------------------------------------------------------------------------- coder


NB32 = -0x55555556                      # 0xaaaaaaaa as an int32


def _epilogue(ulo: torch.Tensor, uhi: torch.Tensor, emax: torch.Tensor) -> torch.Tensor:
    """Transposed negabinary coefficients (see :func:`_transpose`) -> float32 ``(B, 4)``:
    from negabinary, the inverse lifting transform and the inverse cast, column by column."""
    cols = []
    for i in range(S):
        c = ((ulo >> (16 * i)) & 0xFFFF) | (((uhi >> (16 * i)) & 0xFFFF) << 16)
        c = c.to(torch.int32)                         # wraps modulo 2^32
        cols.append((c ^ NB32) - NB32)
    cols = T._inv_lift(*cols)
    s = T._pow2_f32(emax - 30)
    return torch.stack([c.to(torch.float32) * s for c in cols], dim=1)


def _transpose(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``(B, 4)`` coefficients -> two words: low / high 16 bits of coefficient i at
    bits ``16 i`` (multiplications by constants: vectorized, unlike variable shifts)."""
    w = torch.tensor([1, 1 << 16, 1 << 32, 1 << 48], dtype=torch.int64, device=u.device)
    return ((u & 0xFFFF) * w).sum(1), ((u >> 16) * w).sum(1)


def _untranspose(ulo: torch.Tensor, uhi: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_transpose`."""
    return torch.stack([((ulo >> (16 * i)) & 0xFFFF) | (((uhi >> (16 * i)) & 0xFFFF) << 16)
                        for i in range(S)], dim=1)


# The general 1-D path (any maxbits; used for rates above 16): codes are written into a flat
# stream of 32-bit words at each block's bit offset.


def encode(blocks: torch.Tensor, starts: torch.Tensor, maxbits: int, nwords: int,
           G: int = 2) -> torch.Tensor:
    """Write the zfp code of float32 ``blocks: (B, 4)`` at bit offsets ``starts`` into a new
    stream of ``nwords`` 32-bit words (returned as int64, one word per element). ``G`` (1, 2
    or 4) bit planes are coded per table lookup."""
    if G not in (1, 2, 4):
        raise ValueError(f"fast1d.encode: G={G!r} must be 1, 2 or 4 (a divisor of 16)")
    dev = blocks.device
    words = torch.zeros(nwords + 2, dtype=torch.int64, device=dev)
    emax = T.block_emax(blocks)
    e = (emax + T.EBIAS).to(torch.int64)
    nonzero = e != 0
    _write(words, starts, (2 * e + 1) * nonzero.long())
    budget = maxbits - 1 - T.EBITS
    if budget <= 0 or not bool(nonzero.any()):
        return words[:nwords]
    idx = nonzero.nonzero().squeeze(1)
    blocks, starts = blocks.index_select(0, idx), starts.index_select(0, idx) + 1 + T.EBITS
    u = T.fwd_order(T.fwd_xform(T.fwd_cast(blocks, emax.index_select(0, idx)), 1), 1)
    vlo, vhi = _transpose(u)
    table = _enc_table(G).to(dev)
    mult = sum(1 << (48 - 12 * i) for i in range(S))
    pos = torch.zeros_like(starts)
    n = torch.zeros_like(starts)
    one = torch.ones_like(starts)
    for k in range(32 - G, -1, -G):
        # planes k+G-1 .. k of the four coefficients, as 4 fields of G bits at bits 16 i
        # (G divides 16, so a group never straddles the two words)
        p = ((vhi >> (k - 16)) if k >= 16 else (vlo >> k)) & (((1 << G) - 1) * _M1)
        if G == 4:
            key = ((p * mult) >> 48) & 0xFFFF
        else:
            key = (p | (p >> (16 - G)) | (p >> (32 - 2 * G)) | (p >> (48 - 3 * G))) & \
                ((1 << (S * G)) - 1)
        ent = table.index_select(0, (n << (S * G)) + key)
        code = ent & 0xFFFFFFFFFF
        ln = (ent >> 40) & 0xFF
        left = (budget - pos).clamp(min=0, max=40)
        code = code & ((one << left) - 1)                  # nothing past the block's budget
        _write(words, starts + pos.clamp(max=budget), code)
        pos = pos + ln
        n = (ent >> 48) & 0xFF
        if not bool((pos < budget).any()):
            break
    return words[:nwords]


def decode(words: torch.Tensor, starts: torch.Tensor, maxbits: int) -> torch.Tensor:
    """Inverse of :func:`encode`: float32 ``(B, 4)`` blocks of the stream ``words``."""
    dev = words.device
    words = torch.cat([words, torch.zeros(2, dtype=torch.int64, device=dev)])
    head = _read(words, starts, 1 + T.EBITS)
    nonzero = (head & 1).bool()
    emax = ((head >> 1) - T.EBIAS).to(torch.int32)
    B = starts.shape[0]
    out = torch.zeros(B, S, dtype=torch.float32, device=dev)
    budget = maxbits - 1 - T.EBITS
    if budget <= 0 or not bool(nonzero.any()):
        return out
    idx = nonzero.nonzero().squeeze(1)
    st = starts.index_select(0, idx) + 1 + T.EBITS
    table = _dec_table().to(dev)
    pos = torch.zeros_like(st)
    n = torch.zeros_like(st)
    ulo = torch.zeros_like(st)
    uhi = torch.zeros_like(st)
    for k in range(31, -1, -1):
        left = (budget - pos).clamp(min=0, max=8)
        peek = _read(words, st + pos.clamp(max=budget), 8)
        ent = table.index_select(0, (n * 9 + left) * 256 + peek)
        x = ent & _M1
        if k >= 16:
            uhi |= x << (k - 16)
        else:
            ulo |= x << k
        pos = pos + ((ent >> 1) & 15)
        n = (ent >> 5) & 7
        if k % 4 == 0 and not bool((pos < budget).any()):
            break
    u = _untranspose(ulo, uhi)
    f = T.inv_cast(T.inv_xform(T.inv_order(u, 1), 1), emax.index_select(0, idx))
    out.index_copy_(0, idx, f)
    return out


# ------------------------------------------------- single-word blocks (maxbits <= 64)


def decode_words_by_plane(acc: torch.Tensor, maxbits: int) -> torch.Tensor:
    """int64 ``(B,)`` block codes (:func:`moeflow.comm.codecs.zfp.group_encode.encode_words`)
    -> float32 ``(B, 4)``, one table lookup per bit plane: the reference for, and the fallback
    of, :func:`moeflow.comm.codecs.zfp.window_decode.decode_words`."""
    nonzero = (acc & 1).bool()
    emax = (((acc >> 1) & 0xFF) - T.EBIAS).to(torch.int32)
    budget = maxbits - 1 - T.EBITS
    B = acc.shape[0]
    if budget <= 0:
        return torch.zeros(B, S, dtype=torch.float32, device=acc.device)
    body = acc >> (1 + T.EBITS)
    if maxbits == 64:
        body = body & ((1 << (64 - 1 - T.EBITS)) - 1)           # undo sign extension
    table = _dec_table().to(acc.device)
    pos = torch.zeros_like(acc)
    noff = torch.zeros_like(acc)                           # n * 9 * 256
    ulo = torch.zeros_like(acc)
    uhi = torch.zeros_like(acc)
    ULO, UHI, rows = ulo, uhi, None                        # full-size results, live subset
    cpu = acc.device.type == "cpu"
    for k in range(31, -1, -1):
        # pos never passes budget + 8 <= 63: past the budget a lookup consumes nothing
        left = (budget - pos).clamp_(min=0, max=8)
        ent = table.index_select(0, noff + (left << 8) + ((body >> pos) & 0xFF))
        if k >= 16:
            uhi |= (ent & _M1) << (k - 16)
        else:
            ulo |= (ent & _M1) << k
        pos += (ent >> 1) & 15
        noff = ent >> 49
        if cpu and k % 2 == 0:
            live = pos < budget
            nlive = int(live.sum())
            if nlive == 0:
                break
            if nlive * 2 < pos.shape[0]:                   # go on with the live blocks only
                if rows is None:
                    ULO, UHI = ulo.clone(), uhi.clone()
                    rows = torch.arange(pos.shape[0], device=acc.device)
                else:
                    ULO.index_copy_(0, rows, ulo)
                    UHI.index_copy_(0, rows, uhi)
                sel = live.nonzero().squeeze(1)
                rows, body, pos, noff = rows[sel], body[sel], pos[sel], noff[sel]
                ulo, uhi = ulo[sel], uhi[sel]
    if rows is not None:
        ULO.index_copy_(0, rows, ulo)
        UHI.index_copy_(0, rows, uhi)
        ulo, uhi = ULO, UHI
    f = _epilogue(ulo, uhi, emax)
    return torch.where(nonzero.unsqueeze(1), f, torch.zeros_like(f))
