"""Encoder for 2-D and 3-D ZFP blocks (16 or 64 values), any rate: the torch path of
``zfp.compress(..., dims=2|3)``, used where neither the Triton kernels nor the compiled numba
coder run (Lindstrom 2014 sections 3.1-3.4: block-floating-point cast, separable lifting
transform, sequency order, negabinary, then zfp's fixed-rate ``encode_ints``), vectorized over
blocks in plain torch. Output equals LLNL zfp's bit for bit.

How a bit plane is coded, in closed form. With ``n`` coefficients already significant, zfp
writes the plane's first ``n`` bits verbatim, then a group test ``1`` and a unary scan to each
further one-bit, and a final group test ``0`` (section 3.4). Written out, that is: the ``n``
verbatim bits, a ``1``, then every remaining position ``i < n'`` (``n'`` = one past the plane's
highest one-bit) as ``0`` for a zero and ``11`` for a one, with the very last bit cleared (the
second ``1`` of the last one-bit becomes the closing group test ``0``; for an empty rest, the
lone ``1`` becomes the ``0``). When the last one-bit is coefficient ``S - 1`` zfp writes neither
its bit nor a closing test: the last two bits are dropped instead. Positions past ``n'`` expand
to zero bits, so the code's value needs no cutting, only its length:
``L = n' + 1 + ones`` (``L = S + ones - 1`` when ``n' = S``, ``L = S`` when ``n = S``).

So a plane is coded 16 positions at a time by one table lookup per 16-bit chunk: the chunk's
bits and where ``n`` falls relative to it (before it, inside it at position r, or after it)
give the chunk's code, its length and its highest one-bit; the chunk codes are concatenated,
the last bit fixed as above, and the plane code is or-ed into the block's int64 code words at
its bit position (masked to the ``maxbits`` budget: zfp's fixed rate). For 16-value blocks the
fix-up is folded into one table indexed by (``n``, plane). Once ``n = S`` every further plane
is written verbatim, so the rest of the budget is a plain bit copy of the remaining planes
(:func:`bitops.copy_bits`); only blocks still finding significant coefficients go through the
per-plane loop, and the loop goes on with those alone once they are fewer than half.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from moeflow.comm.codecs.zfp import bitops, group_encode, torch_backend, transform as T

NB32 = -0x55555556                    # 0xaaaaaaaa as an int32: the negabinary mask
_CHUNK = 16                           # positions per table lookup
_STATES = _CHUNK + 2                  # n inside the chunk at r = 0..15, after it, before it
_AFTER, _BEFORE = _CHUNK, _CHUNK + 1


@functools.lru_cache(maxsize=None)
def _chunk_table_np() -> np.ndarray:
    """Entry for ``state << 16 | v`` (v = 16 plane bits of a chunk): ``code | len << 40 |
    msb1 << 48``. State r < 16: bits below r verbatim, a group-test ``1`` before position r,
    positions from r expanded (``0`` -> ``0``, ``1`` -> ``11``); state 16: all verbatim (n past
    the chunk); state 17: all expanded (n before the chunk). ``msb1`` = 1 + the chunk's highest
    one-bit (0 for none)."""
    v = np.arange(1 << _CHUNK, dtype=np.int64)
    out = []
    for st in range(_STATES):
        code = np.zeros_like(v)
        ln = np.zeros_like(v)
        for i in range(_CHUNK):
            b = (v >> i) & 1
            if st == i:                                    # the first group test: a one
                code |= 1 << ln
                ln += 1
            if i < st <= _CHUNK:                           # verbatim
                code |= b << ln
                ln += 1
            else:                                          # 0 -> 0, 1 -> 11
                code |= (3 * b) << ln
                ln += 1 + b
        msb1 = np.zeros_like(v)
        for i in range(_CHUNK):
            msb1 = np.where((v >> i) & 1 == 1, i + 1, msb1)
        out.append(code | (ln << 40) | (msb1 << 48))
    return np.concatenate(out)


@functools.lru_cache(maxsize=None)
def _plane16_table_np() -> np.ndarray:
    """16-value blocks: entry for ``n << 16 | plane`` = ``code | L << 32 | (n' << 16) << 40``,
    the plane's whole (untruncated) code with the closing fix-up applied."""
    ch = _chunk_table_np()
    rows = []
    S = _CHUNK
    for n in range(S + 1):
        st = _AFTER if n == S else n
        ent = ch[st << 16: (st + 1) << 16]
        code = ent & ((1 << 40) - 1)
        ln = (ent >> 40) & 0xFF
        nn = np.maximum(n, ent >> 48)
        if n == S:
            L = np.full_like(ln, S)
        else:
            L = np.where(nn < S, ln - (S - nn), ln - 2)
            fix = np.where(nn < S, np.int64(1) << (L - 1), np.int64(3) << L)
            code = code & ~fix
        if int(code.max()) >> 32 or int(L.max()) > 32:
            raise AssertionError("zfp plane table: a 16-value plane code longer than 32 bits")
        rows.append(code | (L << 32) | ((nn << 16) << 40))
    return np.concatenate(rows)


@functools.lru_cache(maxsize=None)
def _table(name: str, device: str) -> torch.Tensor:
    t = _chunk_table_np() if name == "chunk" else _plane16_table_np()
    return torch.from_numpy(t).to(device)


def coefficients(blocks: torch.Tensor, d: int, emax: torch.Tensor, special: bool) -> torch.Tensor:
    """Sections 3.1-3.3: float32 ``(B, 4^d)`` blocks -> int32 negabinary coefficients in
    sequency order (wrapping 32-bit arithmetic, as zfp's)."""
    if special:
        s = T._pow2_f32(30 - emax).unsqueeze(1)
        y = blocks * s
        y = torch.where(y.abs() < 2.0 ** 31, y, -(2.0 ** 31))
    else:                                                 # 2^(30 - emax) is a normal float32
        y = blocks * ((157 - emax) << 23).view(torch.float32).unsqueeze(1)
    i = T.fwd_xform(y.to(torch.int32), d)
    i = i.index_select(1, T.perm_index(d, str(blocks.device)))
    return (i + NB32) ^ NB32


def _place(words: torch.Tensor, bitpos: torch.Tensor, code: torch.Tensor) -> None:
    """Or non-negative ``code`` (< 2^40) into each row's int64 ``words`` at ``bitpos`` (the
    target bits are zero and the code ends inside the row)."""
    nw = words.shape[1]
    w = bitpos >> 6
    sh = bitpos & 63
    words.scatter_add_(1, w.clamp(max=nw - 1).unsqueeze(1), (code << sh).unsqueeze(1))
    words.scatter_add_(1, (w + 1).clamp(max=nw - 1).unsqueeze(1), (code >> (64 - sh)).unsqueeze(1))


def encode_words(blocks: torch.Tensor, d: int, maxbits: int) -> torch.Tensor:
    """float32 ``(B, 4^d)`` blocks (d = 2 or 3) -> int64 ``(B, ceil(maxbits / 64))``: each
    block's whole ``maxbits``-bit zfp code (word j = code bits 64 j..64 j + 63, first stream bit
    lowest), for any ``maxbits >= 9``."""
    S = 4 ** d
    if d not in (2, 3) or blocks.dim() != 2 or blocks.shape[1] != S:
        raise ValueError(f"plane_encode.encode_words: blocks of shape {tuple(blocks.shape)} "
                         f"for d={d}; expected d in (2, 3) and shape (B, {4 ** d})")
    if maxbits < 1 + T.EBITS:
        raise ValueError(f"plane_encode.encode_words: maxbits={maxbits} must be >= 9")
    nw = -(-maxbits // 64)
    dev = blocks.device
    blocks = blocks.contiguous()
    B = blocks.shape[0]
    bits = blocks.view(torch.int32) & 0x7FFFFFFF
    emax, keep, special = group_encode.exponents_of(bits, bits.amax(1))
    nonzero = keep != 0
    words = torch.zeros(B, nw, dtype=torch.int64, device=dev)
    words[:, 0] = torch.where(nonzero, 2 * (emax.long() + T.EBIAS) + 1, 0)
    budget = maxbits - 1 - T.EBITS
    rows = nonzero.nonzero().squeeze(1)                   # an all-zero block is one 0 bit
    if budget == 0 or rows.numel() == 0:
        return words
    u = coefficients(blocks.index_select(0, rows), d, emax.index_select(0, rows), special)
    planes = torch.cat([bitops.to_planes(u, True), bitops.to_planes(u, False)], 1)  # (R, 32)
    string = planes.view(torch.int64)                     # the planes as one bit string
    _code_planes(words, rows, planes, string, S, budget)
    return words


def _code_planes(words, rows, planes, string, S, budget):
    """The per-plane loop over the blocks ``rows`` (their ``planes``, highest first), then the
    verbatim tail copy for blocks that reached ``n = S``; or-s the bodies into ``words``."""
    dev = words.device
    R = rows.numel()
    ws = words.index_select(0, rows)                      # working rows' words
    idx = torch.arange(R, device=dev)                     # working rows -> planes rows
    pos = torch.zeros(R, dtype=torch.int64, device=dev)
    n = torch.zeros(R, dtype=torch.int64, device=dev)     # S = 16: n << 16 (a table offset)
    shift = 16 if S == 16 else 0
    tail_idx, tail_pos, tail_next = [], [], []
    table = _table("plane16" if S == 16 else "chunk", str(dev))
    full = S << shift

    def retire(keep: torch.Tensor, j_next: int) -> None:
        nonlocal ws, idx, pos, n
        out = ~keep
        if bool(out.any()):
            o = out.nonzero().squeeze(1)
            words.index_copy_(0, rows.index_select(0, idx[o]), ws.index_select(0, o))
            t = o[(n[o] == full) & (pos[o] < budget)]     # the rest is verbatim: copy later
            if t.numel() and j_next < 32:
                tail_idx.append(idx[t])
                tail_pos.append(pos[t])
                tail_next.append(torch.full_like(t, j_next))
        k = keep.nonzero().squeeze(1)
        ws, idx, pos, n = ws[k], idx[k], pos[k], n[k]

    for j in range(32):                                   # plane 31 - j
        p = planes[:, j] if idx.numel() == planes.shape[0] else planes[idx, j]
        rem = (budget - pos).clamp(min=0)
        if S == 16:
            ent = table.index_select(0, n + (p.long() & 0xFFFF))
            code = ent & 0xFFFFFFFF & bitops.low_mask(rem.clamp(max=32))
            _place(ws, 1 + T.EBITS + pos, code)
            pos = pos + ((ent >> 32) & 0xFF)
            n = ent >> 40
        else:
            pos, n = _code_plane64(ws, table, p, n, pos, rem)
        live = (n < full) & (pos < budget)
        nlive = int(live.sum())
        if nlive == 0 or j == 31:
            retire(torch.zeros_like(live), j + 1)
            break
        if nlive * 2 < live.numel():
            retire(live, j + 1)
    if tail_idx:
        ti, tp, tn = torch.cat(tail_idx), torch.cat(tail_pos), torch.cat(tail_next)
        r = rows.index_select(0, ti)
        dst = words.index_select(0, r)
        length = torch.minimum(budget - tp, S * (32 - tn))
        bitops.copy_bits(dst, 1 + T.EBITS + tp, string.index_select(0, ti), S * tn, length,
                         budget)
        words.index_copy_(0, r, dst)


def _code_plane64(ws, table, p, n, pos, rem):
    """One bit plane ``p`` (int64, 64 coefficients) of every working block: four chunk lookups,
    the closing fix-up, placement. Returns the new ``(pos, n)``."""
    S = 64
    ents = []
    nn = n
    for c in range(S // _CHUNK):
        st = n - _CHUNK * c
        st = torch.where(st < 0, _BEFORE, st.clamp(max=_AFTER))
        v = (p >> (_CHUNK * c)) & 0xFFFF
        e = table.index_select(0, (st << 16) | v)
        ents.append(e)
        m1 = e >> 48
        nn = torch.maximum(nn, torch.where(m1 > 0, _CHUNK * c + m1, 0))
    lens = [(e >> 40) & 0xFF for e in ents]
    offs = [torch.zeros_like(n)]
    for ln in lens[:-1]:
        offs.append(offs[-1] + ln)
    total = offs[-1] + lens[-1]
    done = n == S
    short = nn < S
    L = torch.where(done, S, torch.where(short, total - (S - nn), total - 2))
    fixrel = torch.where(short, L - 1, L)
    fixbits = torch.where(done, 0, torch.where(short, 1, 3))
    for c in range(S // _CHUNK):
        code = ents[c] & ((1 << 40) - 1)
        code = code & ~(fixbits << (fixrel - offs[c])) & bitops.low_mask((rem - offs[c])
                                                                         .clamp(0, 64))
        _place(ws, 1 + T.EBITS + pos + offs[c], code)
    return pos + L, nn


def compress(a: torch.Tensor, d: int, maxbits: int, chunk: int = 1 << 14) -> torch.Tensor:
    """Like ``torch_backend.compress(a, d, maxbits)`` for d = 2 or 3, by this coder (blocks
    coded ``chunk`` at a time to keep temporaries in cache)."""
    lead = a.shape[: a.dim() - d]
    blocks = T.to_blocks(a, d)
    per = T.blocks_per_array(a.shape, d)
    nslices = blocks.shape[0] // per
    codes = torch.cat([encode_words(blocks[i:i + chunk], d, maxbits)
                       for i in range(0, blocks.shape[0], chunk)])
    words = torch_backend.pack_codes(codes, nslices, per, maxbits)
    return words.contiguous().view(torch.uint8).reshape(*lead, -1)
