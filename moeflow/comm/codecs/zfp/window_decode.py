"""Windowed table decoder for 1-D ZFP blocks whose whole code fits one int64 (``maxbits <= 64``,
rates up to 16): the CPU decode path of the ``zfp`` codec (Lindstrom 2014 section 3.4, zfp's
fixed-rate ``decode_ints`` for a 4-value block), vectorized over blocks.

Each step looks up 16 stream bits at once. A table indexed by (``n``, the number of
significant coefficients; ``L = min(bits left in the block's budget, 16)``; the next ``L``
bits) gives the bit planes those bits decode to, how many bits and planes that is, and the new
``n``:

* ``L = 16`` (at least 16 bits of budget left): every plane that ends inside the window, up to
  16 planes (a plane codes in at most 8 bits, so a step consumes at least 9);
* ``L < 16`` (the end of the budget is inside the window): zfp's decoder run to the end of the
  budget, including what it does when the budget runs out inside a plane (it sets the bit of
  the coefficient being scanned), so the result is exactly zfp's.

At rate 8 (a 23-bit body) a block takes two steps, against one lookup per bit plane (8 to 16
of them) in :func:`moeflow.comm.codecs.zfp.fast1d.decode_words_by_plane`. The decoded planes
are put straight into place in two words per block (coefficients 0, 1 and 2, 3 as the low and
high 32 bits), whose halves are the four int32 coefficients. The number of steps is fixed by
the budget (no host synchronisation per step). zfp stops after plane 0
(32 planes) even when budget is left. No code the encoder writes got there in our tests at
these sizes, but an arbitrary one can (a nonzero block with an all-zero body at 64 bits):
such blocks are found afterwards and decoded by the plane-by-plane decoder.
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


def decode_words(acc: torch.Tensor, maxbits: int) -> torch.Tensor:
    """int64 ``(B,)`` block codes (as :func:`fast1d.encode_words` makes them, ``maxbits <= 64``)
    -> float32 ``(B, 4)``, exactly as zfp decodes them."""
    if not 1 + T.EBITS <= maxbits <= 64:
        raise ValueError(f"window_decode.decode_words: maxbits={maxbits} must be in [9, 64]")
    B = acc.shape[0]
    budget = maxbits - 1 - T.EBITS
    if budget == 0 or B == 0:
        return torch.zeros(B, S, dtype=torch.float32, device=acc.device)
    flag = acc & 1
    emax = (((acc >> 1) & 0xFF) - T.EBIAS).to(torch.int32).clamp_(min=-126)
    body = (acc >> (1 + T.EBITS)) & ((1 << budget) - 1) & -flag   # an all-zero block: no body
    ta, tb, tm = _tables(str(acc.device))
    if budget >= W:                                     # first step: n = 0, pos = 0, L = 16
        idx = (body & ((1 << W) - 1)) | (1 << W)
        meta = tm.index_select(0, idx)
        s = 32 - ((meta >> 8) & 31)                     # where this step's last plane lands
        A = ta.index_select(0, idx) << s
        Bw = tb.index_select(0, idx) << s
        pos = meta & 31
        noff = meta >> 40
    else:
        s = torch.full_like(acc, 32)
        A = torch.zeros_like(acc)
        Bw = torch.zeros_like(acc)
        pos = torch.zeros_like(acc)
        noff = torch.zeros_like(acc)
    for _ in range(_steps(budget) - (budget >= W)):  # a fixed count: no host sync per step
        L = (budget - pos).clamp_(max=W)
        idx = noff | (1 << L) | ((body >> pos) & ((1 << W) - 1))
        meta = tm.index_select(0, idx)
        s -= (meta >> 8) & 31
        A |= ta.index_select(0, idx) << s
        Bw |= tb.index_select(0, idx) << s
        pos += meta & 31
        noff = meta >> 40
    # the coefficients as int32 columns (the low / high halves of A and Bw), from negabinary
    # (wrapping in 32 bits), through the inverse lifting transform, cast back to float
    cols = [c.to(torch.int32) for c in (A, A >> 32, Bw, Bw >> 32)]
    cols = T._inv_lift(*[(c ^ NB32) - NB32 for c in cols])
    scale = T._pow2_f32(emax - 30)
    out = torch.empty(B, S, dtype=torch.float32, device=acc.device)
    for i, c in enumerate(cols):
        torch.mul(c.to(torch.float32), scale, out=out[:, i])
    over = (s < 0) & (flag == 1)                        # ran past plane 0: zfp stops there
    if bool(over.any()):
        rows = over.nonzero().squeeze(1)
        out.index_copy_(0, rows, fast1d.decode_words_by_plane(acc.index_select(0, rows),
                                                              maxbits))
    return out
