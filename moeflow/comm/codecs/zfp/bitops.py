"""Bit-level helpers of the 2-D/3-D ZFP coder (:mod:`.plane_encode`, :mod:`.plane_decode`),
vectorized over blocks in plain torch.

* **Bit-plane transposition** (Lindstrom 2014 section 3.4 codes a block's integer coefficients
  one bit plane at a time): :func:`to_planes` turns ``S = 16`` or ``64`` int32 coefficients per
  block into their 32 bit planes (plane ``k`` = bit ``k`` of every coefficient, coefficient
  ``i`` at bit ``i``), :func:`from_planes` goes back. Both run a 16 x 16 bit-matrix transpose on
  the 16-bit halves of the coefficients, four rows to an int64 word, in four delta-swap stages
  (the classic recursive transpose: swap 8x8, 4x4, 2x2 and 1x1 sub-blocks), about four word
  operations per value for all 32 planes instead of one mask-and-shift per plane and value.
* **Bit-string access at per-block offsets**: :func:`read64` reads 64 bits starting at any bit
  of a block's int64 words, :func:`copy_bits` ors a bit range of one per-block word string into
  another at another offset.

Words hold stream bits LSB first (bit ``b`` of a string is bit ``b % 64`` of word ``b // 64``),
as zfp's 64-bit stream words do on a little-endian machine.
"""

from __future__ import annotations

import sys

import torch

_M8 = 0x00FF00FF00FF00FF       # low byte of each 16-bit field
_M4 = 0x0F0F0F0F0F0F0F0F       # low nibble of each byte
_M2 = 0x00000000CCCCCCCC       # columns 2, 3 (mod 4) of rows 0, 1 (mod 4)
_M1 = 0x0000AAAA0000AAAA       # odd columns of even rows

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("moeflow's ZFP bit-plane coder assumes a little-endian machine")


def _swap(a: torch.Tensor, b: torch.Tensor, shift: int, mask: int):
    """Delta swap between two words: the bits ``mask << shift`` of ``a`` trade places with
    the bits ``mask`` of ``b``."""
    t = ((a >> shift) ^ b) & mask
    return a ^ (t << shift), b ^ t


def _transpose16(w: torch.Tensor) -> torch.Tensor:
    """16 x 16 bit matrices, rows ``4 j .. 4 j + 3`` as the 16-bit fields of word ``j`` of
    ``w: (..., 4)`` int64 (row ``r`` bit ``c`` = entry (r, c)) -> their transposes, same
    layout. Four delta-swap stages; arithmetic shifts are harmless (their sign bits are masked
    off)."""
    w0, w1, w2, w3 = w.unbind(-1)
    # 8x8 quadrants: rows r < 8 (words 0, 1) trade their high bytes for the low bytes of r + 8
    w0, w2 = _swap(w0, w2, 8, _M8)
    w1, w3 = _swap(w1, w3, 8, _M8)
    # 4x4: rows r and r + 4 (words 0|1 and 2|3), high nibble of each byte for the low
    w0, w1 = _swap(w0, w1, 4, _M4)
    w2, w3 = _swap(w2, w3, 4, _M4)
    out = torch.stack([w0, w1, w2, w3], -1)
    # 2x2 (rows r, r + 2: fields f, f + 2 of one word, 30 bits apart) and 1x1 (15 bits apart)
    t = ((out >> 30) ^ out) & _M2
    out = out ^ t ^ (t << 30)
    t = ((out >> 15) ^ out) & _M1
    return out ^ t ^ (t << 15)


def _halves(u: torch.Tensor, high: bool) -> torch.Tensor:
    """The high (or low) 16 bits of int32 ``u: (B, S)`` as int64 words ``(B, S / 4)``
    (coefficient ``i`` in field ``i % 4`` of word ``i // 4``)."""
    h = u.contiguous().view(torch.int16)[:, int(high)::2].contiguous()
    return h.view(torch.int64)


def to_planes(u: torch.Tensor, high: bool = True) -> torch.Tensor:
    """Bit planes 31..16 (``high``) or 15..0 of int32 coefficients ``u: (B, S)``, S = 16 or
    64, highest plane first: int16 ``(B, 16)`` for S = 16, int64 ``(B, 16)`` for S = 64 (bit
    ``i`` = coefficient ``i``)."""
    B, S = u.shape
    w = _halves(u, high)                                   # (B, S / 4)
    if S == 16:
        p = _transpose16(w).view(torch.int16)              # plane 16 q + i at column i
        return p.flip(1)
    if S != 64:
        raise ValueError(f"bitops.to_planes: S={S}; expected 16 or 64 coefficients per block")
    p = _transpose16(w.reshape(B, 4, 4)).reshape(B, 16).view(torch.int16)   # (B, group*16+i)
    p = p.reshape(B, 4, 16).transpose(1, 2).contiguous().view(torch.int64).reshape(B, 16)
    return p.flip(1)


def from_planes(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_planes`: planes 31..16 ``hi`` and 15..0 ``lo`` (as it returns
    them) -> int32 coefficients ``(B, S)``."""
    B = hi.shape[0]
    halves = []
    for p in (lo, hi):
        p = p.flip(1)
        if p.dtype == torch.int16:                         # S = 16
            h = _transpose16(p.contiguous().view(torch.int64)).view(torch.int16)
        else:                                              # S = 64
            g = p.contiguous().view(torch.int16).reshape(B, 16, 4).transpose(1, 2)
            h = _transpose16(g.contiguous().view(torch.int64)).reshape(B, 16).view(torch.int16)
        halves.append(h)
    return torch.stack(halves, -1).view(torch.int32).reshape(B, -1)


def low_mask(nbits: torch.Tensor) -> torch.Tensor:
    """int64 with the low ``nbits`` bits set, for 0 <= nbits <= 64 (torch shifts by 64 give 0,
    so 64 gives all ones)."""
    return torch.where(nbits >= 64, -1, (1 << nbits.clamp(max=63)) - 1)


def read64(words: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The 64 bits at bit ``start`` of each row of int64 ``words: (B, nw)`` (``start`` may run
    past the end: missing bits read as garbage the caller masks off; negative ``start`` reads
    bits the caller masks off too)."""
    nw = words.shape[1]
    a = start >> 6
    sh = start & 63
    lo = words.gather(1, a.clamp(0, nw - 1).unsqueeze(1)).squeeze(1)
    hi = words.gather(1, (a + 1).clamp(0, nw - 1).unsqueeze(1)).squeeze(1)
    # a logical right shift: the arithmetic one's sign copies are masked off
    return ((lo >> sh) & ((1 << (64 - sh)) - 1)) | (hi << (64 - sh))


def copy_bits(dst: torch.Tensor, dst_off: torch.Tensor, src: torch.Tensor,
              src_off: torch.Tensor, length: torch.Tensor, max_length: int) -> None:
    """Or ``length`` bits of ``src`` from bit ``src_off`` into ``dst`` at bit ``dst_off``, row by
    row (``dst: (B, nd)``, ``src: (B, ns)`` int64; ``length <= max_length``, every written bit
    inside ``dst``; the target bits must be zero). Disjoint bits add like an or, so the words
    are accumulated with ``scatter_add_``."""
    nd = dst.shape[1]
    end = dst_off + length
    q0 = dst_off >> 6
    for j in range(-(-max_length // 64) + 1):               # dst words the range can touch
        q = q0 + j
        lo_bit = torch.maximum(dst_off - 64 * q, torch.zeros_like(q))    # within word q
        hi_bit = (end - 64 * q).clamp(max=64)
        keep = low_mask(hi_bit.clamp(min=0)) & ~low_mask(lo_bit.clamp(max=64))
        keep = torch.where(hi_bit > lo_bit, keep, 0)
        val = read64(src, src_off + 64 * q - dst_off) & keep
        dst.scatter_add_(1, q.clamp(max=nd - 1).unsqueeze(1), val.unsqueeze(1))
