"""Triton kernels for ZFP fixed-rate coding on CUDA of 2-D and 3-D blocks, and of 1-D blocks
above 64 bits (Lindstrom 2014, sections 3.1-3.4; the compressor of ScheMoE section 3.1),
bit-exact with zfpy and the reference coder (``tests/reference/zfp_bitplane.py``).

One lane owns one block of ``S = 4^d`` values (zfp order, z slowest): it gathers the block with
zfp's padding, casts, lifts, reorders and maps to negabinary, then runs the embedded coder as
one flat loop of ``S + 32`` steps (each one group test and its run, or the end of a plane and
the next plane's verbatim bits), or-ing its bits into the stream with 32-bit atomics. Decoding
mirrors it with zfp's decoder rules. Tested under ``TRITON_INTERPRET=1`` and compiled for sm_90
without a GPU (``tests/unit/zfp/test_zfp_triton_nd.py``); see ``docs/codecs.md``.
"""

from __future__ import annotations

import functools
import math

import torch

from moeflow.comm.codecs.zfp.transform import perm_index, stream_bytes

try:                                                     # optional dependency (extra "gpu")
    import triton
    import triton.language as tl
except ImportError:                                      # pragma: no cover
    triton = None
    tl = None

BLOCKS = {1: 128, 2: 64, 3: 32}                                  # zfp blocks (lanes) per program
NUM_WARPS = {1: 4, 2: 8, 3: 8}                                 # no register spills on sm_90


def available() -> bool:
    """Whether the Triton kernels can run (triton importable)."""
    return triton is not None


if triton is not None:
    # the 4-point lifting steps, the float -> int cast, negabinary and the stream words
    from moeflow.comm.codecs.zfp.triton_common import (_fwd_lift, _get64, _inv_lift,
                                                       _negabinary, _put64, _to_int)

    # ------------------------------------------------------------- 64-bit word helpers
    # Bit patterns live in int64; no shift is ever by 64 or more (undefined on the GPU).

    @triton.jit
    def _lowmask(m):
        # int64 with the low m bits set, 0 <= m <= 64
        one = tl.full(m.shape, 1, tl.int64)
        return tl.where(m >= 64, -1, (one << tl.minimum(m, 63)) - 1)

    @triton.jit
    def _shr(x, s):
        # logical right shift of an int64 bit pattern by 0 <= s <= 64
        one = tl.full(s.shape, 1, tl.int64)
        sc = tl.minimum(s, 63)
        keep = (((one << (63 - sc)) - 1) << 1) | 1        # the low 64 - sc bits
        return tl.where(s >= 64, 0, (x >> sc) & keep)

    @triton.jit
    def _ctz(v):
        # number of trailing zero bits of an int64 bit pattern (64 for 0): the exponent of
        # its lowest set bit, read from that power of two converted (exactly) to float32
        low = v & (0 - v)
        e = ((low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        return tl.where(v == 0, 64, e.to(tl.int64))

    @triton.jit
    def _col(P, k):
        # P[lane, k[lane]] of an int64 (lanes, 32) table of plane words
        kk = tl.arange(0, 32)
        return tl.sum(tl.where(kk[None, :] == k[:, None], P, 0), axis=1)

    # ------------------------------------------------------------ block geometry

    @triton.jit
    def _pad(o, m):
        # zfp's padding of a partial block of width m (section 3.1): offset o in 0..3 reads
        # o (m >= 4), a a a a (m = 1), a b b a (m = 2), a b c a (m = 3)
        return tl.where(o < m, o, tl.where((m == 2) & (o == 2), 1, 0))

    @triton.jit
    def _lanes(pid, nblocks, per, nbx, nby, B: tl.constexpr):
        # lane -> (live, slice, block in slice, block coordinates): blocks in zfp order
        b = (pid * B + tl.arange(0, B)).to(tl.int64)
        live = b < nblocks
        sl = b // per
        bi = b % per
        bx = bi % nbx
        by = (bi // nbx) % nby
        bz = bi // (nbx * nby)
        return live, sl, bi, bx, by, bz

    # ------------------------------------------------------ lifting (section 3.2)

    @triton.jit
    def _lift4(t, B: tl.constexpr, S: tl.constexpr, INV: tl.constexpr):
        # zfp's 4-point lifting (or its inverse) of each run of 4 consecutive entries of the
        # int32 (B, S) block tensor: entries 4r + 2h + l are split by l, then by h
        a, b = tl.split(tl.reshape(t, [B, S // 4, 2, 2]))
        c0, c2 = tl.split(a)
        c1, c3 = tl.split(b)
        if INV:
            c0, c1, c2, c3 = _inv_lift(c0, c1, c2, c3)
        else:
            c0, c1, c2, c3 = _fwd_lift(c0, c1, c2, c3)
        return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [B, S])

    @triton.jit
    def _swap(t, B: tl.constexpr, D: tl.constexpr, AX: tl.constexpr):
        # exchange zfp's x (fastest) with y (AX=1) or z (AX=2) in the (B, S) block tensor,
        # so that the lifting of _lift4 runs along that axis (an involution)
        if D == 2:
            r = tl.reshape(tl.permute(tl.reshape(t, [B, 4, 4]), (0, 2, 1)), [B, 16])
        elif AX == 1:
            r = tl.reshape(tl.permute(tl.reshape(t, [B, 4, 4, 4]), (0, 1, 3, 2)), [B, 64])
        else:
            r = tl.reshape(tl.permute(tl.reshape(t, [B, 4, 4, 4]), (0, 3, 2, 1)), [B, 64])
        return r

    @triton.jit
    def _fwd_xform(t, B: tl.constexpr, S: tl.constexpr, D: tl.constexpr):
        # forward transform: along x, then y, then z (zfp's fwd_xform)
        t = _lift4(t, B, S, False)
        if D >= 2:
            t = _swap(_lift4(_swap(t, B, D, 1), B, S, False), B, D, 1)
        if D == 3:
            t = _swap(_lift4(_swap(t, B, D, 2), B, S, False), B, D, 2)
        return t

    @triton.jit
    def _inv_xform(t, B: tl.constexpr, S: tl.constexpr, D: tl.constexpr):
        # inverse transform: along z, then y, then x (zfp's inv_xform)
        if D == 3:
            t = _swap(_lift4(_swap(t, B, D, 2), B, S, True), B, D, 2)
        if D >= 2:
            t = _swap(_lift4(_swap(t, B, D, 1), B, S, True), B, D, 1)
        return _lift4(t, B, S, True)

    # ------------------------------------------------------------------ encoder

    @triton.jit
    def _encode_kernel(x_ptr, out_ptr, rank_ptr, nblocks, per, nbx, nby, nx, ny, nz,
                       slice_words, D: tl.constexpr, S: tl.constexpr, MAXBITS: tl.constexpr,
                       B: tl.constexpr):
        pid = tl.program_id(0)
        live, sl, bi, bx, by, bz = _lanes(pid, nblocks, per, nbx, nby, B)
        # gather the block with zfp's partial-block padding (section 3.1); c = x + 4 y + 16 z
        c = tl.arange(0, S)
        gx = 4 * bx[:, None] + _pad((c & 3)[None, :], nx - 4 * bx[:, None])
        gy = 4 * by[:, None] + _pad(((c >> 2) & 3)[None, :], ny - 4 * by[:, None])
        gz = 4 * bz[:, None] + _pad((c >> 4)[None, :], nz - 4 * bz[:, None])
        off = ((sl[:, None] * nz + gz) * ny + gy) * nx + gx
        f = tl.load(x_ptr + off, mask=live[:, None], other=0.0)
        # common exponent: frexp exponent of the largest magnitude, NaN skipped, inf -> 0,
        # -127 for an all-zero block (transform.block_emax)
        a = tl.where(f != f, 0.0, tl.abs(f))
        amax = tl.max(a, axis=1)
        be = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        emax = tl.maximum(be - 126, -126)
        emax = tl.where(amax == 0.0, -127, emax)
        emax = tl.where(be == 0xFF, 0, emax)
        e = emax + 127
        nonzero = live & (e != 0)
        # block-floating-point cast: trunc(x * 2^(30 - emax)), s = ldexpf(1, 30 - emax)
        # (inf when 30 - emax > 127), INT_MIN for what is not finite or not below 2^31
        es = 30 - emax
        s = tl.where(es > 127, float("inf"),
                     ((tl.minimum(es, 127) + 127) << 23).to(tl.float32, bitcast=True))
        i = _to_int(f * s[:, None])
        # decorrelating transform (section 3.2), then negabinary (section 3.3)
        i = _fwd_xform(i, B, S, D)
        u = _negabinary(i)
        # bit plane k of the block in sequency order: coefficient c goes to bit rank[c]
        # (rank = inverse of PERM[d]); P[lane, k] holds plane k's S bits
        rank = tl.load(rank_ptr + c).to(tl.int64)
        kk = tl.arange(0, 32)
        P = tl.zeros([B, 32], dtype=tl.int64)
        for k in range(32):
            pk = tl.sum(((u >> k) & 1) << rank[None, :], axis=1)
            P = tl.where(kk[None, :] == k, pk[:, None], P)
        # header: nonzero bit, then the biased exponent in 8 bits
        start = sl * slice_words * 32 + bi * MAXBITS
        _put64(out_ptr, start, 2 * e.to(tl.int64) + 1, nonzero)
        # embedded bit-plane coder (section 3.4, zfp's encode_ints in fixed-rate mode), one
        # step per iteration: the plane's next group test and its run, or the end of the plane
        # and the first n bits of the next plane verbatim
        BUDGET: tl.constexpr = MAXBITS - 9
        base = start + 9
        one = tl.full([B], 1, tl.int64)
        k = tl.full([B], 31, tl.int64)                   # the plane being coded
        n = tl.zeros([B], dtype=tl.int64)                # coefficients found significant
        pos = tl.zeros([B], dtype=tl.int64)              # body bits written
        x = _col(P, k)                                   # plane k's bits from n on
        for _ in range(S + 32):
            alive = nonzero & (k >= 0) & (pos < BUDGET)
            grp = alive & (n < S)                        # a group test is coded
            more = x != 0                                # its bit: any one-bit left?
            run = grp & more
            p = _ctz(x)                                  # zeros before that one-bit
            endbit = (n + p) < (S - 1)                   # the last coefficient's one is implied
            onepos = pos + 1 + p
            code = tl.where(endbit & (onepos < BUDGET), one << tl.minimum(p + 1, 63), 0) | 1
            _put64(out_ptr, base + pos, code, run)       # group bit 1, p zeros, the one-bit
            n0 = n
            pos = tl.where(grp, pos + 1, pos)
            pos = tl.where(run, pos + p + endbit.to(tl.int64), pos)
            n = tl.where(run, n + p + 1, n)
            x = tl.where(run, _shr(x, p + 1), x)
            # the plane ends at a group bit 0, or once every coefficient is significant
            done = alive & ((n0 >= S) | (~more) | (n >= S))
            k = tl.where(done, k - 1, k)
            adv = done & (k >= 0)
            xk = _col(P, k)
            m = tl.minimum(n, tl.maximum(BUDGET - pos, 0))
            _put64(out_ptr, base + pos, xk & _lowmask(m), adv)   # first n bits verbatim
            pos = tl.where(adv, pos + m, pos)
            x = tl.where(adv, _shr(xk, n), x)

    # ------------------------------------------------------------------ decoder

    @triton.jit
    def _decode_kernel(in_ptr, y_ptr, rank_ptr, nblocks, per, nbx, nby, nx, ny, nz,
                       slice_words, nwords, D: tl.constexpr, S: tl.constexpr,
                       MAXBITS: tl.constexpr, B: tl.constexpr):
        pid = tl.program_id(0)
        live, sl, bi, bx, by, bz = _lanes(pid, nblocks, per, nbx, nby, B)
        start = sl * slice_words * 32 + bi * MAXBITS
        head = _get64(in_ptr, start, nwords, live)
        nonzero = live & ((head & 1) != 0)
        emax = (((head >> 1) & 0xFF) - 127).to(tl.int32)
        # bit-plane decoder (section 3.4, zfp's decode_ints in fixed-rate mode): the flat
        # loop of the encoder; P[lane, k] collects plane k's bits (0 for planes not reached)
        BUDGET: tl.constexpr = MAXBITS - 9
        base = start + 9
        one = tl.full([B], 1, tl.int64)
        kk = tl.arange(0, 32)
        P = tl.zeros([B, 32], dtype=tl.int64)
        k = tl.full([B], 31, tl.int64)
        n = tl.zeros([B], dtype=tl.int64)
        pos = tl.zeros([B], dtype=tl.int64)
        x = tl.zeros([B], dtype=tl.int64)                # plane k's bits read so far
        for _ in range(S + 32):
            alive = nonzero & (k >= 0) & (pos < BUDGET)
            grp = alive & (n < S)
            win = _get64(in_ptr, base + pos, nwords, grp)
            more = (win & 1) != 0                        # the group test bit
            run = grp & more
            # zeros up to the next one-bit, at most to the last coefficient (whose one is
            # implied) and to the budget; a run cut short still sets the bit it stopped at
            r = tl.maximum(BUDGET - pos - 1, 0)
            zc = _ctz(_shr(win, one))
            smax = tl.maximum(S - 1 - n, 0)
            z = tl.minimum(tl.minimum(zc, smax), r)
            found = (zc < smax) & (zc < r)               # the one-bit itself was read
            n0 = n
            pos = tl.where(grp, pos + 1, pos)
            pos = tl.where(run, pos + z + found.to(tl.int64), pos)
            x = tl.where(run, x | (one << tl.minimum(n + z, 63)), x)
            n = tl.where(run, n + z + 1, n)
            done = alive & ((n0 >= S) | (~more) | (n >= S))
            P = tl.where(kk[None, :] == k[:, None], x[:, None], P)
            k = tl.where(done, k - 1, k)
            adv = done & (k >= 0)
            m = tl.minimum(n, tl.maximum(BUDGET - pos, 0))
            v = _get64(in_ptr, base + pos, nwords, adv)
            x = tl.where(adv, v & _lowmask(m), x)        # first n bits verbatim
            pos = tl.where(adv, pos + m, pos)
        P = tl.where(kk[None, :] == k[:, None], x[:, None], P)   # a plane cut by the budget
        # planes -> negabinary coefficients in block order (inverse of PERM[d], section 3.3)
        c = tl.arange(0, S)
        rank = tl.load(rank_ptr + c).to(tl.int64)
        u = tl.zeros([B, S], dtype=tl.int64)
        for kp in range(32):
            pk = tl.sum(tl.where(kk[None, :] == kp, P, 0), axis=1)
            u = u | (((pk[:, None] >> rank[None, :]) & 1) << kp)
        i = ((u ^ 0xAAAAAAAA) - 0xAAAAAAAA).to(tl.int32)   # wraps modulo 2^32
        i = _inv_xform(i, B, S, D)                       # section 3.2, inverse
        # float(i) * 2^(emax - 30) with s = ldexpf(1, emax - 30): normal, subnormal or 0
        es = emax - 30
        s_norm = ((tl.maximum(es, -126) + 127) << 23).to(tl.float32, bitcast=True)
        s_sub = (tl.full([B], 1, tl.int32) << tl.minimum(tl.maximum(es + 149, 0), 22))
        s_sub = tl.where(es >= -149, s_sub, 0).to(tl.float32, bitcast=True)
        s = tl.where(es >= -126, s_norm, s_sub)
        g = tl.where(nonzero[:, None], i.to(tl.float32) * s[:, None], 0.0)
        # store, dropping the padding of partial blocks
        gx = 4 * bx[:, None] + (c & 3)[None, :]
        gy = 4 * by[:, None] + ((c >> 2) & 3)[None, :]
        gz = 4 * bz[:, None] + (c >> 4)[None, :]
        inside = live[:, None] & (gx < nx) & (gy < ny) & (gz < nz)
        off = ((sl[:, None] * nz + gz) * ny + gy) * nx + gx
        tl.store(y_ptr + off, g, mask=inside)


# ----------------------------------------------------------------------- launchers


@functools.lru_cache(maxsize=None)
def _rank(d: int, device: str) -> torch.Tensor:
    """rank[c] = position of block entry c in zfp's sequency order (inverse of PERM[d])."""
    return perm_index(d, device, inverse=True).to(torch.int32)


def _geometry(shape: tuple[int, ...], d: int):
    """(lead shape, slices, (nz, ny, nx), (nbz, nby, nbx), blocks per slice)."""
    if d not in (1, 2, 3):
        raise ValueError(f"triton_nd codes 1-D, 2-D and 3-D blocks; got d={d!r}")
    if len(shape) < d or any(s == 0 for s in shape):
        raise ValueError(f"triton_nd: shape {tuple(shape)} cannot be coded with d={d}")
    lead = tuple(shape[: len(shape) - d])
    dims = tuple(shape[len(shape) - d:])
    nz, ny, nx = (1,) * (3 - d) + dims
    nbz, nby, nbx = -(-nz // 4), -(-ny // 4), -(-nx // 4)
    return lead, math.prod(lead), (nz, ny, nx), (nbz, nby, nbx), nbz * nby * nbx


def compress(a: torch.Tensor, d: int, maxbits: int) -> torch.Tensor:
    """float32 array whose last ``d`` dims form one zfp array per leading index -> uint8
    ``(*lead, stream_bytes)``, byte-identical to ``bitplane.compress(a, d, maxbits)``. Runs
    where Triton runs ``a`` (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    if not available():
        raise RuntimeError("triton_nd.compress needs triton")
    lead, nslices, (nz, ny, nx), (_, nby, nbx), per = _geometry(tuple(a.shape), d)
    a = a.to(torch.float32).contiguous()
    nbytes = stream_bytes(per, maxbits)
    out = torch.zeros(nslices * nbytes // 4, dtype=torch.int32, device=a.device)
    nblocks = nslices * per
    B = BLOCKS[d]
    _encode_kernel[(triton.cdiv(nblocks, B),)](
        a, out, _rank(d, str(a.device)), nblocks, per, nbx, nby, nx, ny, nz, nbytes // 4,
        D=d, S=4 ** d, MAXBITS=maxbits, B=B, num_warps=NUM_WARPS[d])
    return out.view(torch.uint8).reshape(*lead, nbytes)


def decompress(data: torch.Tensor, shape: tuple[int, ...], d: int, maxbits: int) -> torch.Tensor:
    """Inverse of :func:`compress` (``shape`` is the original array's shape): float32, exactly
    what ``bitplane.decompress(data, shape, d, maxbits)`` decodes."""
    if not available():
        raise RuntimeError("triton_nd.decompress needs triton")
    shape = tuple(int(s) for s in shape)
    lead, nslices, (nz, ny, nx), (_, nby, nbx), per = _geometry(shape, d)
    nbytes = stream_bytes(per, maxbits)
    rows = data.reshape(nslices, nbytes).contiguous()
    if rows.storage_offset() % 4:                        # int32 view needs 4-byte alignment
        rows = rows.clone()
    words = rows.view(torch.int32).reshape(-1)
    out = torch.empty(shape, dtype=torch.float32, device=data.device)
    nblocks = nslices * per
    B = BLOCKS[d]
    _decode_kernel[(triton.cdiv(nblocks, B),)](
        words, out, _rank(d, str(data.device)), nblocks, per, nbx, nby, nx, ny, nz,
        nbytes // 4, words.numel(), D=d, S=4 ** d, MAXBITS=maxbits, B=B,
        num_warps=NUM_WARPS[d])
    return out


__all__ = ["available", "compress", "decompress"]
