"""Group-table encoder for 1-D ZFP blocks, any rate: the torch encode path of the ``zfp`` codec,
used where neither the Triton kernels nor the compiled numba coder run (Lindstrom 2014
sections 3.1-3.4: block-floating-point cast, lifting transform, negabinary, and zfp's
fixed-rate ``encode_ints`` for a 4-value block), vectorized over blocks.

Bit planes are coded four at a time: the four coefficients' bits of planes ``k+3..k`` (16 bits)
and the number ``n`` of coefficients already significant index a table holding those planes'
code, its length and the new ``n`` (:func:`moeflow.comm.codecs.zfp.fast1d._enc_table`). Codes
are shifted into place at the block's running bit position in its int64 code words (one word
up to rate 16); bits past ``maxbits`` are masked off at the end, which is exactly zfp's
truncation of the last plane. At rate 8 almost every block has spent its 23-bit budget after
two or three groups (planes 31..20); the blocks still going are carried on alone once they are
fewer than half.

The coefficients are laid out "transposed", the 16 high (or low) bits of coefficient ``i`` at
bits ``16 i`` of one int64, built by writing int16 halves into an ``(B, 4)`` int16 buffer that
is then viewed as int64; the low halves are only built for blocks that reach plane 15.
"""

from __future__ import annotations

import functools
import sys

import torch

from moeflow.comm.codecs.zfp import fast1d, transform as T

S = 4
NB32 = fast1d.NB32
_FIELDS = 0xF * fast1d._M1                       # a nibble in each 16-bit field
_MULT = sum(1 << (48 - 12 * i) for i in range(S))   # gathers the 4 nibbles into bits 48..63
_LITTLE = sys.byteorder == "little"


@functools.lru_cache(maxsize=None)
def _table(device: str) -> torch.Tensor:
    """``code | len << 32 | (n' << 16) << 40`` for index ``n << 16 | planes`` (4 planes)."""
    t = fast1d._enc_table(4)
    code = t & 0xFFFFFFFFFF
    ln = (t >> 40) & 0xFF
    nn = (t >> 48) & 0xFF
    if int(code.max()) >> 32:                    # 4 planes code in at most 28 bits
        raise AssertionError("zfp group table: a 4-plane code longer than 32 bits")
    return (code | (ln << 32) | ((nn << 16) << 40)).to(device)


def block_exponents(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(emax, keep, special)`` of float32 ``(B, 4)`` blocks: see :func:`exponents_of`."""
    bits = blocks.view(torch.int32) & 0x7FFFFFFF
    m = torch.maximum(torch.maximum(bits[:, 0], bits[:, 1]), torch.maximum(bits[:, 2], bits[:, 3]))
    return exponents_of(bits, m)


def exponents_of(bits: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(emax, keep, special)`` of blocks as zfp computes ``emax`` (see
    :func:`transform.block_emax`), from the bit patterns ``bits = x.view(int32) & 0x7FFFFFFF``
    of the blocks ``(B, S)`` and their row maxima ``m``: the largest ``|x|`` (NaNs skipped)
    is the largest pattern with the sign bit cleared. ``emax`` is 0 for all-zero blocks, ``keep``
    is -1 (all bits set) for a nonzero block and 0 for an all-zero one, and ``special`` says
    whether any block holds inf or NaN or is so small (``emax < -97``) that zfp's scale
    ``2^(30 - emax)`` overflows float32."""
    top = int(m.max()) if m.numel() else 0
    if top > 0x7F800000:                         # a NaN: zfp's max skips it
        m = torch.where(bits > 0x7F800000, 0, bits).amax(1)
    be = m >> 23
    emax = (be - 126).clamp_(min=-126)
    if top >= 0x7F800000:                        # inf (or NaN): glibc's frexp gives 0
        emax = torch.where(be == 0xFF, 0, emax)
    keep = ~((m - 1) >> 31)                      # m == 0 <=> m - 1 < 0
    emax &= keep
    low = int(emax.min()) < -97 if emax.numel() else False
    return emax, keep, top >= 0x7F800000 or low


def _halves(cols: list[torch.Tensor], high: bool) -> torch.Tensor:
    """The 16 high (or low) bits of four int32 columns as one int64 per row, field i = col i."""
    h = torch.empty(cols[0].shape[0], S, dtype=torch.int16, device=cols[0].device)
    for i, c in enumerate(cols):
        if _LITTLE:
            h[:, i] = c.view(torch.int16)[int(high)::2]
        else:                                    # pragma: no cover
            h[:, i] = (c >> 16).to(torch.int16) if high else c.to(torch.int16)
    return h.view(torch.int64).squeeze(1)


def encode_words(blocks: torch.Tensor, maxbits: int) -> torch.Tensor:
    """float32 ``(B, 4)`` -> int64 ``(B, ceil(maxbits / 64))``: each block's whole ``maxbits``-bit
    zfp code (header and body; word j holds code bits 64 j..64 j + 63, the first stream bit
    lowest), for any ``maxbits >= 9``."""
    if maxbits < 1 + T.EBITS:
        raise ValueError(f"group_encode.encode_words: maxbits={maxbits} must be >= 9")
    nw = -(-maxbits // 64)
    blocks = blocks.contiguous()
    B = blocks.shape[0]
    emax, keep, special = block_exponents(blocks)
    keep = keep.long()
    words = [((2 * (emax.long() + T.EBIAS) + 1) & keep)]
    words += [torch.zeros_like(words[0]) for _ in range(nw - 1)]
    if maxbits == 1 + T.EBITS or B == 0:
        return torch.stack(words, 1)
    # block-floating-point cast (section 3.1): trunc(x * 2^(30 - emax)); the product is below
    # 2^30 unless the scale or x is not finite (tiny blocks, inf, NaN): only then is the
    # out-of-range case (INT_MIN, as x86's cvttss2si gives it) needed.
    if special:
        s = T._pow2_f32(30 - emax)
    else:                                        # 2^(30 - emax) is a normal float32
        s = ((157 - emax) << 23).view(torch.float32)
    cols = []
    for i in range(S):
        y = blocks[:, i] * s
        if special:
            y = torch.where(y.abs() < 2.0 ** 31, y, -(2.0 ** 31))
        cols.append(y.to(torch.int32))
    cols = [(c + NB32) ^ NB32 for c in T._fwd_lift(*cols)]   # section 3.2-3.3, wrapping
    table = _table(str(blocks.device))
    v = _halves(cols, high=True)
    full, rows = words, None                     # full-size result, live subset
    pos = noff = None
    for k in range(28, -1, -4):                  # planes k+3..k, top first (section 3.4)
        if k == 12:                              # the low halves, for the blocks still going
            v = _halves([c if rows is None else c.index_select(0, rows) for c in cols], False)
        p = (v >> (k % 16)) & _FIELDS
        key = ((p * _MULT) >> 48) & 0xFFFF
        ent = table.index_select(0, key if noff is None else noff + key)
        code = ent & 0xFFFFFFFF
        if pos is None:
            pos = torch.full_like(code, 1 + T.EBITS)
        # torch defines a shift by a negative amount or by 64 or more as 0 (for these
        # non-negative codes), so of the two shifts below exactly the right one is nonzero
        words[0] |= code << pos
        for j in range(1, nw):                   # the part of the code in word j
            words[j] |= (code << (pos - 64 * j)) | (code >> (64 * j - pos))
        pos = pos + ((ent >> 32) & 0xFF)
        noff = ent >> 40
        if k == 0:
            break
        live = pos < maxbits
        nlive = int(live.sum())
        if nlive == 0:
            break
        if nlive * 2 < pos.shape[0]:             # go on with the live blocks only
            if rows is None:
                full = list(words)
                rows = torch.arange(B, device=blocks.device)
            else:
                for j in range(nw):
                    full[j].index_copy_(0, rows, words[j])
            sel = live.nonzero().squeeze(1)
            rows, pos, noff, v = rows[sel], pos[sel], noff[sel], v[sel]
            words = [w[sel] for w in words]
    if rows is not None:
        for j in range(nw):
            full[j].index_copy_(0, rows, words[j])
        words = full
    out = torch.stack(words, 1) & keep.unsqueeze(1)   # an all-zero block codes as one 0 bit
    if maxbits % 64:
        out[:, -1] &= (1 << (maxbits % 64)) - 1
    return out
