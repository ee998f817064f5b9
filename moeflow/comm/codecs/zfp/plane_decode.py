"""Decoder for 2-D and 3-D ZFP blocks (16 or 64 values), any rate: the torch path of
``zfp.decompress(..., dims=2|3)``, used where neither the Triton kernels nor the compiled numba
coder run (Lindstrom 2014 section 3.4, zfp's fixed-rate ``decode_ints``, then the inverse of
sections 3.1-3.3), vectorized over blocks in plain torch.
Output equals LLNL zfp's decoding bit for bit.

Every working block runs zfp's decoder as a small state machine, all blocks in lockstep, one
step per iteration:

* at the start of a bit plane, the first ``n`` bits (``n`` = coefficients already significant)
  are read verbatim, in one 64-bit read;
* then one table lookup decodes up to ``W = 12`` further stream bits of the plane's group tests
  and unary scans. The table is indexed by where the decoder is (at a group test, or inside a
  scan), how far ``n`` is from the block's last coefficient (zfp implies the one-bit of
  coefficient ``S - 1`` without reading it), the bits left in the window (``min(budget, W)``:
  a shorter window is the end of the budget, where zfp's cut-short scan still sets the bit it
  stopped at) and the window's bits. It returns the one-bits found, how far ``n`` moved, the
  bits consumed, where the decoder is now, and whether the plane ended.

A block whose ``n`` reaches ``S`` has nothing but verbatim planes left, so the rest of its
budget is copied into the plane string in one :func:`bitops.copy_bits`. The loop goes on with
the blocks still decoding alone once they are fewer than half. Finally the planes are
transposed back into coefficients (:func:`bitops.from_planes`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from moeflow.comm.codecs.zfp import bitops, torch_backend, transform as T

NB32 = -0x55555556
W = 12                                  # stream bits per lookup
_DD = W + 3                             # distance S - n, clamped: 0, 1, ..., W + 2 (= far)
_ROW = 1 << (W + 1)                     # entries per (mode, distance): (1 << L) | bits


@functools.lru_cache(maxsize=None)
def _group_table_np() -> np.ndarray:
    """Entry for ``((mode - 1) * DD + dist) << (W + 1) | 1 << L | w``: ``y | dn << 20 |
    used << 26 | mode' << 32 | done << 34``. Mode 1: at a group test (zfp's outer loop), mode 2:
    inside a unary scan (its inner loop); ``dist = min(S - n, W + 2)``; ``L = min(bits left,
    W)``; ``y`` = the one-bits found, at bit ``i`` for coefficient ``n + i``."""
    idx = np.arange(2 * _DD * _ROW, dtype=np.int64)
    mode = idx // (_DD * _ROW) + 1
    dist = (idx // _ROW) % _DD
    low = idx % _ROW
    L = np.zeros_like(idx)
    for ln in range(1, W + 1):
        L[(low >> ln) > 0] = ln
    w = np.where(low > 0, low - (np.int64(1) << L), 0)
    end = L < W                                         # the budget ends inside this window
    far = dist == _DD - 1
    y = np.zeros_like(idx)
    dn = np.zeros_like(idx)
    used = np.zeros_like(idx)
    done = np.zeros(idx.shape, dtype=bool)
    stop = low == 0                                     # unused index (no L marker)
    for _ in range(2 * W + 6):                          # enough steps for any entry
        go = ~done & ~stop
        left = np.where(far, 1 << 20, dist - dn)        # S - n now
        have = used < L
        bit = (w >> used) & 1
        # mode 1 (outer loop top): `for (; bits && n < size; n++) { bits--; if (!read) break;`
        m1 = go & (mode == 1)
        fin = m1 & ((left == 0) | (~have & end))
        done |= fin
        pause = m1 & ~fin & ~have                       # window exhausted, budget goes on
        stop |= pause
        rd = m1 & ~fin & have
        used += rd
        done |= rd & (bit == 0)
        mode = np.where(rd & (bit == 1), 2, mode)
        # mode 2 (inner scan): `for (; bits && n < size - 1; n++) { bits--; if (read) break; }
        # x += 1 << n;` then the outer n++
        m2 = go & (mode == 2) & ~rd
        implied = m2 & ((left == 1) | (~have & end))    # n = S - 1, or cut short by budget
        pause = m2 & ~implied & ~have
        stop |= pause
        rd2 = m2 & ~implied & have
        used += rd2
        one = implied | (rd2 & (bit == 1))
        y |= np.where(one, np.int64(1) << np.minimum(dn, 62), 0)
        dn += one | (rd2 & (bit == 0))
        mode = np.where(one, 1, mode)
        done |= implied & (~have & end)                 # cut short: the outer loop ends too
    return y | (dn << 20) | (used << 26) | (mode << 32) | (done.astype(np.int64) << 34)


@functools.lru_cache(maxsize=None)
def _table(device: str) -> torch.Tensor:
    return torch.from_numpy(_group_table_np()).to(device)


def decode_words(codes: torch.Tensor, d: int, maxbits: int) -> torch.Tensor:
    """int64 block codes ``(B, ceil(maxbits / 64))`` (as :func:`plane_encode.encode_words`
    makes them) -> float32 ``(B, 4^d)`` blocks, exactly as zfp decodes them (d = 2 or 3)."""
    S = 4 ** d
    nw = -(-maxbits // 64)
    if d not in (2, 3) or maxbits < 1 + T.EBITS or codes.dim() != 2 or codes.shape[1] != nw:
        raise ValueError(f"plane_decode.decode_words: codes of shape {tuple(codes.shape)}, "
                         f"d={d}, maxbits={maxbits}; expected d in (2, 3), maxbits >= 9 and "
                         f"shape (B, {nw})")
    B = codes.shape[0]
    dev = codes.device
    out = torch.zeros(B, S, dtype=torch.float32, device=dev)
    budget = maxbits - 1 - T.EBITS
    head = codes[:, 0]
    rows = (head & 1).nonzero().squeeze(1)              # nonzero blocks
    if budget == 0 or rows.numel() == 0:
        return out
    emax = (((head.index_select(0, rows) >> 1) & 0xFF) - T.EBIAS).to(torch.int32)
    ptype = torch.int16 if S == 16 else torch.int64
    planes = torch.zeros(rows.numel(), 32, dtype=ptype, device=dev)
    _decode_planes(codes.index_select(0, rows), planes, S, budget)
    u = bitops.from_planes(planes[:, :16], planes[:, 16:])
    v = (u ^ NB32) - NB32
    i = T.inv_xform(v.index_select(1, T.perm_index(d, str(dev), inverse=True)), d)
    out.index_copy_(0, rows, T.inv_cast(i, emax.clamp(min=-126)))
    return out


def _decode_planes(codes: torch.Tensor, planes: torch.Tensor, S: int, budget: int) -> None:
    """Decode the bodies of ``codes`` (nonzero blocks) into ``planes`` (highest first)."""
    dev = codes.device
    R = codes.shape[0]
    table = _table(str(dev))
    string = planes.view(torch.int64)                   # the planes as one bit string
    idx = torch.arange(R, device=dev)
    cw = codes
    wp = planes                                         # the working blocks' planes
    zeros = torch.zeros(R, dtype=torch.int64, device=dev)
    pos, n, j, x = zeros, zeros, zeros, zeros
    mode = torch.zeros_like(zeros)                      # 0: plane start, 1/2 as in the table
    tails = []
    base = 1 + T.EBITS
    while True:
        # finished: a plane start with no budget or no plane left; verbatim rest: n = S
        start = mode == 0
        fin = start & ((pos >= budget) | (j >= 32))
        tail = start & ~fin & (n == S)
        work = ~(fin | tail)
        nwork = int(work.sum())
        if nwork * 2 < work.numel() or nwork == 0:
            if wp is not planes:
                planes.index_copy_(0, idx, wp)
            t = tail.nonzero().squeeze(1)
            if t.numel():
                tails.append((idx[t], pos[t], j[t], cw.index_select(0, t)))
            k = work.nonzero().squeeze(1)
            if k.numel() == 0:
                break
            idx, cw, pos, n, j, x, mode = (idx[k], cw.index_select(0, k), pos[k], n[k], j[k],
                                           x[k], mode[k])
            wp = planes.index_select(0, idx)
            start = mode == 0
        # verbatim part of a plane start (elsewhere m = 0: nothing read); x is 0 there
        st = start.long()
        m = st * torch.minimum(n, budget - pos)
        r = bitops.read64(cw, base + pos)
        x = x | (r & ((1 << m) - 1))
        pos = pos + m
        mode = mode + st
        # one window of group tests / scans
        L = (budget - pos).clamp_(0, W)
        if S == 16:                                     # the window follows in the same read
            win = (r >> m) & ((1 << L) - 1)
        else:
            win = bitops.read64(cw, base + pos) & ((1 << L) - 1)
        dist = (S - n).clamp_(max=_DD - 1)
        ent = table.index_select(0, ((((mode - 1) * _DD + dist) << (W + 1)) | (1 << L) | win))
        x = x | ((ent & 0xFFFFF) << n)
        n = n + ((ent >> 20) & 63)
        pos = pos + ((ent >> 26) & 63)
        # a finished plane goes to its column (adding zero elsewhere; a block past plane 0
        # that is still in the working set adds nothing)
        ended = (ent >> 34) & 1
        done = ended * (j < 32)
        mode = ((ent >> 32) & 3) * (1 - ended)
        wp.scatter_add_(1, j.clamp(max=31).unsqueeze(1), (x * done).to(wp.dtype).unsqueeze(1))
        j = j + ended
        x = x * (1 - ended)
    for ti, tp, tj, tc in tails:
        dst = string.index_select(0, ti)
        length = torch.minimum(budget - tp, S * (32 - tj))
        bitops.copy_bits(dst, S * tj, tc, base + tp, length, budget)
        string.index_copy_(0, ti, dst)


def decompress(data: torch.Tensor, shape: tuple[int, ...], d: int, maxbits: int,
               chunk: int = 1 << 14) -> torch.Tensor:
    """Like ``torch_backend.decompress(data, shape, d, maxbits)`` for d = 2 or 3."""
    per = T.blocks_per_array(shape, d)
    nbytes = data.shape[-1]
    rows = data.reshape(-1, nbytes).contiguous()
    if rows.storage_offset() % 8:                       # int64 view needs 8-byte alignment
        rows = rows.clone()
    codes = torch_backend.unpack_codes(rows.view(torch.int64), per, maxbits)
    blocks = torch.cat([decode_words(codes[i:i + chunk], d, maxbits)
                        for i in range(0, codes.shape[0], chunk)])
    return T.from_blocks(blocks, tuple(shape), d)
