"""Windowed table decoder for 1-D ZFP blocks, any rate: the torch decode path of the ``zfp``
codec, used where neither the Triton kernels nor the compiled numba coder run (Lindstrom 2014
section 3.4, zfp's fixed-rate ``decode_ints`` for a 4-value block, and the inverse transform of
sections 3.1-3.3), vectorized over blocks.

Each step looks up 16 stream bits at once. A table indexed by (``n``, the number of
significant coefficients; ``L = min(bits left in the block's budget, 16)``; the next ``L``
bits) gives the bit planes those bits decode to, how many bits and planes that is, and the new
``n``:

* ``L = 16`` (at least 16 bits of budget left): every plane that ends inside the window, up to
  16 planes (a plane codes in at most 7 bits, so a step consumes at least 10);
* ``L < 16`` (the end of the budget is inside the window): zfp's decoder run to the end of the
  budget, including what it does when the budget runs out inside a plane (it sets the bit of
  the coefficient being scanned), so the result is exactly zfp's.

At rate 8 (a 23-bit body) a block takes two steps, against one lookup per bit plane (8 to 16
of them) for a plane-at-a-time decoder. The decoded planes are put straight into place in two
words per block (coefficients 0, 1 and 2, 3 as the low and high 32 bits), whose halves are the
four int32 coefficients. The number of steps is bounded by the budget (at rate 8: two, with no
host synchronisation); above that the decoder stops early once every block is done. Codes
longer than 64 bits are read through overlapping 63-bit words at a 32-bit stride, so that any
window lies in one word. zfp stops after plane 0 (32 planes) even when budget is left, which
a block can reach only with more than 32 bits of budget; planes decoded beyond it are shifted
out and masked off.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from moeflow.comm.codecs.zfp import fast1d, transform as T

S = 4                       # values per 1-D block
W = 16                      # stream bits per lookup
_ROW = 1 << (W + 1)         # table entries per n: index (1 << L) | w for L = 0..16, w < 2^L


def _decode_plane_np(w, pos, n, bits):
    """zfp's decoder on one plane for arrays of states (numpy int64, changed in place apart
    from the returned plane ``x``): reads from the stream words ``w`` at bit ``pos`` with
    ``bits`` budget left. Same code as :func:`fast1d._decode_plane`, vectorized."""
    m = np.minimum(n, bits)
    x = (w >> pos) & ((np.int64(1) << m) - 1)
    pos += m
    bits -= m
    on = (bits > 0) & (n < S)
    for _ in range(S + 1):                              # group tests: at most 4 ones, one zero
        g = (w >> pos) & 1
        pos += on
        bits -= on
        hit = on & (g == 1)
        scan = hit.copy()
        for _ in range(S - 1):                          # unary run over coefficients n..2
            scan &= (n < S - 1) & (bits > 0)
            b = (w >> pos) & 1
            pos += scan
            bits -= scan
            zero = scan & (b == 0)
            n += zero
            scan = zero
        x |= hit.astype(np.int64) << np.where(hit, n, 0)
        n += hit
        on = hit & (bits > 0) & (n < S)
    return x


@functools.lru_cache(maxsize=None)
def _tables_np() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, meta), 5 * 2^17 int64 entries each, for index ``n << 17 | 1 << L | w``:
    ``a`` = planes of coefficients 0 | 1 << 32, ``b`` = of 2 | 3 << 32 (first plane most
    significant, ``p`` bits each), ``meta`` = bits consumed | p << 8 | (n' << 17) << 40."""
    idx = np.arange((S + 1) * _ROW, dtype=np.int64)
    n = idx // _ROW
    low = idx % _ROW
    L = np.zeros_like(idx)
    for ln in range(1, W + 1):
        L[(low >> ln) > 0] = ln
    w = np.where(low > 0, low - (np.int64(1) << L), 0)
    window = L == W                                     # budget goes on past the window
    bits = np.where(window, 1 << 20, L)
    pos = np.zeros_like(idx)
    planes = np.zeros_like(idx)
    coef = np.zeros((S, idx.size), dtype=np.int64)
    live = np.flatnonzero((low > 0) & (bits > 0))
    for _ in range(W):                                  # one plane of every live entry
        p2, n2, b2 = pos[live], n[live], bits[live]
        x = _decode_plane_np(w[live], p2, n2, b2)
        ok = ~(window[live] & (p2 > W))                 # a windowed plane must end in the window
        live = live[ok]
        pos[live], n[live], bits[live] = p2[ok], n2[ok], b2[ok]
        planes[live] += 1
        for i in range(S):
            coef[i, live] = (coef[i, live] << 1) | ((x[ok] >> i) & 1)
        live = live[bits[live] > 0]
    a = coef[0] | (coef[1] << 32)
    b = coef[2] | (coef[3] << 32)
    meta = pos | (planes << 8) | ((n * _ROW) << 40)
    return a, b, meta


@functools.lru_cache(maxsize=None)
def _tables(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.from_numpy(t).to(device) for t in _tables_np())


NB32 = fast1d.NB32


@functools.lru_cache(maxsize=None)
def _steps(budget: int) -> int:
    """Lookups that decode any block with this budget: windowed steps (each consumes at least
    the fewest bits a full-window entry consumes) until under 16 bits are left, then one."""
    a, b, meta = _tables_np()
    idx = np.arange(S + 1) [:, None] * _ROW + (1 << W) + np.arange(1 << W)[None, :]
    least = int((meta[idx] & 31).min())
    return -(-max(budget - (W - 1), 0) // least) + 1


_JUNK = torch.tensor([~(((1 << k) - 1) << (32 - k)) for k in range(33)], dtype=torch.int64)


def _body_windows(codes: torch.Tensor, budget: int):
    """A function ``pos -> the 16 body bits from pos`` (zeros past the budget) over the int64
    code words ``(B, nw)`` (word j = code bits 64 j..64 j + 63; the body starts at bit 9)."""
    B, nw = codes.shape
    if nw == 1:
        body = (codes[:, 0] >> (1 + T.EBITS)) & ((1 << budget) - 1)
        return lambda pos: (body >> pos) & ((1 << W) - 1)
    # longer codes: the body as overlapping 63-bit words at a 32-bit stride, so that any
    # 16-bit window lies inside word pos >> 5
    def bits_at(o: int, k: int) -> torch.Tensor:        # code bits o..o+k-1, k <= 32
        q, r = divmod(o, 64)
        if q >= nw or k <= 0:
            return torch.zeros(B, dtype=torch.int64, device=codes.device)
        v = ((codes[:, q] >> r) & ((1 << (64 - r)) - 1)) if r else codes[:, q]
        if r + k > 64 and q + 1 < nw:
            v = v | (codes[:, q + 1] << (64 - r))
        return v & ((1 << k) - 1)

    words = []
    for j in range(budget // 32 + 1):
        o = 1 + T.EBITS + 32 * j
        left = budget - 32 * j                          # body bits from 32 j on
        lo = bits_at(o, min(32, left))
        words.append(lo | (bits_at(o + 32, min(31, left - 32)) << 32))
    flat = torch.stack(words, 1).reshape(-1)
    base = torch.arange(B, device=codes.device) * len(words)
    return lambda pos: (flat.index_select(0, base + (pos >> 5)) >> (pos & 31)) & ((1 << W) - 1)


def decode_words(codes: torch.Tensor, maxbits: int) -> torch.Tensor:
    """int64 block codes ``(B, ceil(maxbits / 64))`` (as :func:`group_encode.encode_words` makes
    them: word j holds code bits 64 j..64 j + 63, the first stream bit lowest) -> float32
    ``(B, 4)``, exactly as zfp decodes them. Any ``maxbits >= 9``."""
    nw = -(-maxbits // 64)
    if maxbits < 1 + T.EBITS or codes.dim() != 2 or codes.shape[1] != nw:
        raise ValueError(f"window_decode.decode_words: codes of shape {tuple(codes.shape)} and "
                         f"maxbits={maxbits}; expected maxbits >= 9 and shape (B, {nw})")
    B = codes.shape[0]
    dev = codes.device
    budget = maxbits - 1 - T.EBITS
    if budget == 0 or B == 0:
        return torch.zeros(B, S, dtype=torch.float32, device=dev)
    head = codes[:, 0]
    flag = head & 1
    emax = (((head >> 1) & 0xFF) - T.EBIAS).to(torch.int32).clamp_(min=-126)
    codes = codes & -flag.unsqueeze(1)                  # an all-zero block: no body
    window = _body_windows(codes, budget)
    ta, tb, tm = _tables(str(dev))
    # zfp stops after plane 0 (32 planes) even with budget left; a block can only get there
    # with more than 32 bits of budget. Then planes decoded past plane 0 (s < 0) are dropped:
    # shifted out to the right, with the bits of coefficient 1 (3) that slide into the field
    # of coefficient 0 (2) masked off.
    past_zero = budget > 32
    junk = _JUNK.to(dev) if past_zero else None
    if budget >= W:                                     # first step: n = 0, pos = 0, L = 16
        idx = window(torch.zeros(B, dtype=torch.int64, device=dev)) | (1 << W)
        meta = tm.index_select(0, idx)
        s = 32 - ((meta >> 8) & 31)                     # where this step's last plane lands
        A = ta.index_select(0, idx) << s
        Bw = tb.index_select(0, idx) << s
        pos = meta & 31
        noff = meta >> 40
    else:
        s = torch.full((B,), 32, dtype=torch.int64, device=dev)
        A = torch.zeros(B, dtype=torch.int64, device=dev)
        Bw = torch.zeros_like(A)
        pos = torch.zeros_like(A)
        noff = torch.zeros_like(A)
    steps = _steps(budget) - (budget >= W)             # enough for any block
    for i in range(steps):
        if i and not bool((pos < budget).any()):
            break                                       # every block is done early
        L = (budget - pos).clamp_(max=W)
        idx = noff | (1 << L) | window(pos)
        meta = tm.index_select(0, idx)
        s -= (meta >> 8) & 31
        a, b = ta.index_select(0, idx), tb.index_select(0, idx)
        if past_zero and i + (budget >= W) >= 2:     # 2 steps decode at most 32 planes
            s0 = s.clamp(min=0)
            k = s0 - s
            keep = junk.index_select(0, k.clamp(max=32))
            A |= ((a << s0) >> k) & keep
            Bw |= ((b << s0) >> k) & keep
        else:
            A |= a << s
            Bw |= b << s
        pos += meta & 31
        noff = meta >> 40
    # the coefficients as int32 columns (the low / high halves of A and Bw), from negabinary
    # (wrapping in 32 bits), through the inverse lifting transform, cast back to float
    cols = [c.to(torch.int32) for c in (A, A >> 32, Bw, Bw >> 32)]
    cols = T._inv_lift(*[(c ^ NB32) - NB32 for c in cols])
    scale = T._pow2_f32(emax - 30)
    out = torch.empty(B, S, dtype=torch.float32, device=dev)
    for i, c in enumerate(cols):
        torch.mul(c.to(torch.float32), scale, out=out[:, i])
    return out
