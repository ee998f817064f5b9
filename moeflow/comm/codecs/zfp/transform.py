"""ZFP's block transform, shared by every coder (Lindstrom 2014, "Fixed-rate compressed
floating-point arrays", sections 3.1-3.3; the ZFP codec of ScheMoE section 3.1): blocks of
``4^d`` values (partial blocks padded as zfp pads them); the block-floating-point cast
``trunc(x * 2^(30 - emax))``, the decorrelating lifting transform along x, y, z, the
total-sequency reordering and negabinary map, and their inverses, in torch (the reference
pipeline's steps), with the tables and sizes the compiled coders share. 32-bit integer
arithmetic wraps and float steps round as zfp's C code does (``docs/codecs.md``).
"""

from __future__ import annotations

import functools

import torch

NBMASK = 0xAAAAAAAA
EBITS = 8
EBIAS = 127
INT_MIN = -(1 << 31)


# zfp's coefficient orders (its perm_2 / perm_3 tables): entries "ij" / "ijk" are block entry
# i + 4 j + 16 k, by total sequency i + j + k, then i^2 + j^2 + k^2, ties as zfp orders them.
_ORDER = {2: "00 10 01 11 20 02 21 12 30 03 22 31 13 32 23 33",
          3: "000 100 010 001 011 101 110 200 020 002 111 210 201 021 120 102 012 300 030 003 "
             "211 121 112 022 202 220 310 301 031 130 103 013 122 212 221 311 131 113 320 302 "
             "032 230 203 023 222 321 312 132 231 213 123 033 303 330 322 232 223 133 313 331 "
             "233 323 332 333"}


def _perm(d: int) -> list[int]:
    """Coefficient order of a ``4^d`` block (block entries in sequency order)."""
    if d == 1:
        return [0, 1, 2, 3]
    return [sum(int(c) << (2 * a) for a, c in enumerate(t)) for t in _ORDER[d].split()]


PERM = {d: _perm(d) for d in (1, 2, 3)}
# Sanity: each table is a permutation, sorted by total sequency (the property zfp relies on).
for _d, _p in PERM.items():
    assert sorted(_p) == list(range(4 ** _d))
    _seq = [sum((v >> (2 * a)) & 3 for a in range(_d)) for v in _p]
    assert _seq == sorted(_seq)
del _d, _p, _seq


def maxbits_for(rate: float, d: int) -> int:
    """Bits per block for ``rate`` bits/value in d dimensions, as ``zfp_stream_set_rate`` sets
    them (unaligned): ``floor(4^d * rate + 0.5)``, at least ``1 + 8`` for float32."""
    if not (isinstance(rate, (int, float)) and rate > 0):
        raise ValueError(f"zfp rate={rate!r} is invalid: it must be a positive number of bits "
                         "per value (e.g. 8)")
    if d not in (1, 2, 3):
        raise ValueError(f"zfp dims={d!r} is invalid: choose 1, 2 or 3")
    bits = int((4 ** d) * float(rate) + 0.5)
    return max(bits, 1 + EBITS)


# ---------------------------------------------------------------------------------- blocks


def blocks_per_array(shape, d: int) -> int:
    """Blocks of ``4^d`` values in one array: the product of ``ceil(n / 4)`` over the last ``d``
    axes of ``shape`` (partial blocks count whole)."""
    per = 1
    for n in tuple(shape)[len(shape) - d:]:
        per *= -(-int(n) // 4)
    return per


def stream_bytes(nblocks: int, maxbits: int) -> int:
    """Size of a zfp fixed-rate stream of ``nblocks`` blocks, padded to 64-bit words."""
    return 8 * (-(-nblocks * maxbits // 64))


def pad_index(n: int, device) -> torch.Tensor:
    """Source index along one axis of length n, padded to a multiple of 4 as zfp pads a partial
    block of width m: m=1 -> a a a a, m=2 -> a b b a, m=3 -> a b c a."""
    full = (n // 4) * 4
    idx = list(range(full))
    m = n - full
    if m:
        idx += [full + o for o in ((0, 0, 0, 0), (0, 1, 1, 0), (0, 1, 2, 0))[m - 1]]
    return torch.tensor(idx, dtype=torch.long, device=device)


def to_blocks(a: torch.Tensor, d: int) -> torch.Tensor:
    """``a`` with ``d`` dims (zfp's x is the last axis) -> ``(nblocks, 4^d)`` in zfp's block
    order (z slowest, x fastest) and in-block order (x fastest). Leading dims beyond ``d`` are
    batch dims: each slice is compressed as its own array (blocks stay in slice order)."""
    a = a.reshape(-1, *a.shape[a.dim() - d:])
    for ax in range(1, d + 1):
        n = a.shape[ax]
        if n % 4:
            a = a.index_select(ax, pad_index(n, a.device))
    nb = [a.shape[ax] // 4 for ax in range(1, d + 1)]
    b = a.reshape(-1, *[m for n in nb for m in (n, 4)])          # (.., nb_i, 4, ..)
    return b.permute(0, *range(1, 2 * d, 2), *range(2, 2 * d + 1, 2)).reshape(-1, 4 ** d)


def from_blocks(b: torch.Tensor, shape: tuple[int, ...], d: int) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: drop the padding of partial blocks."""
    lead, dims = tuple(shape[: len(shape) - d]), tuple(shape[len(shape) - d:])
    nb = [-(-n // 4) for n in dims]
    a = b.reshape(-1, *nb, *[4] * d)                              # (.., nb_i.., 4..)
    a = a.permute(0, *[j for i in range(d) for j in (1 + i, 1 + d + i)])
    a = a.reshape(-1, *[4 * n for n in nb])
    a = a[(slice(None),) + tuple(slice(0, n) for n in dims)]
    return a.reshape(*lead, *dims)


# ------------------------------------------------------------- block-floating-point cast


def block_emax(blocks: torch.Tensor) -> torch.Tensor:
    """Per-block exponent as zfp computes it: ``frexp`` exponent of the largest magnitude
    (NaNs are skipped, since zfp's ``max < |x|`` test is false for them), at least -126 for a
    nonzero block, -127 for an all-zero block; an infinite maximum gives 0 (glibc's frexp)."""
    a = blocks.abs()
    a = torch.where(a.isnan(), torch.zeros_like(a), a)
    amax = a.amax(dim=1)
    be = (amax.view(torch.int32) >> 23) & 0xFF
    emax = torch.clamp(be - 126, min=-126)
    emax = torch.where(amax == 0, torch.full_like(emax, -127), emax)
    return torch.where(be == 0xFF, torch.zeros_like(emax), emax)


def _pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """float32 ``2^e`` as ``ldexpf(1, e)`` rounds it (0 below 2^-149, inf above 2^127), built
    from its bits (normal range) or exactly through float64 (the rare rest)."""
    e = e.to(torch.int32)
    normal = ((e.clamp(-126, 127) + 127) << 23).view(torch.float32)
    if bool(((e < -126) | (e > 127)).any()):
        return torch.where((e >= -126) & (e <= 127), normal,
                           torch.exp2(e.to(torch.float64)).to(torch.float32))
    return normal


def fwd_cast(blocks: torch.Tensor, emax: torch.Tensor) -> torch.Tensor:
    """float32 ``(B, n)`` -> int32 ``trunc(x * 2^(30 - emax))``; a product that is not finite
    or not below 2^31 becomes INT_MIN, as x86's ``cvttss2si`` makes it."""
    s = _pow2_f32(30 - emax).unsqueeze(1)
    y = blocks * s
    y = torch.where(y.abs() < 2.0 ** 31, y, torch.full_like(y, float(INT_MIN)))
    return y.to(torch.int32)


def inv_cast(iblock: torch.Tensor, emax: torch.Tensor) -> torch.Tensor:
    """int32 ``(B, n)`` -> float32 ``float(i) * 2^(emax - 30)``, single-precision rounding."""
    return iblock.to(torch.float32) * _pow2_f32(emax - 30).unsqueeze(1)


# ------------------------------------------------------------------ lifting transform


def _fwd_lift(x, y, z, w):
    x = x + w; x = x >> 1; w = w - x
    z = z + y; z = z >> 1; y = y - z
    x = x + z; x = x >> 1; z = z - x
    w = w + y; w = w >> 1; y = y - w
    w = w + (y >> 1); y = y - (w >> 1)
    return x, y, z, w


def _inv_lift(x, y, z, w):
    y = y + (w >> 1); w = w - (y >> 1)
    y = y + w; w = w << 1; w = w - y
    z = z + x; x = x << 1; x = x - z
    y = y + z; z = z << 1; z = z - y
    w = w + x; x = x << 1; x = x - w
    return x, y, z, w


def _lift_axes(iblock: torch.Tensor, d: int, inverse: bool) -> torch.Tensor:
    b = iblock.reshape(-1, *([4] * d))            # (B, [z,] [y,] x)
    axes = list(range(d, 0, -1))                   # x (last) first, then y, then z
    if inverse:
        axes.reverse()
    f = _inv_lift if inverse else _fwd_lift
    for ax in axes:
        b = torch.stack(f(*b.unbind(ax)), dim=ax)
    return b.reshape(iblock.shape)


def fwd_xform(iblock: torch.Tensor, d: int) -> torch.Tensor:
    """zfp's forward decorrelating transform of int32 ``(B, 4^d)`` blocks (wrapping)."""
    return _lift_axes(iblock, d, inverse=False)


def inv_xform(iblock: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of :func:`fwd_xform`."""
    return _lift_axes(iblock, d, inverse=True)


# ------------------------------------------------------------ reorder + negabinary


@functools.lru_cache(maxsize=None)
def perm_index(d: int, device: str, inverse: bool = False) -> torch.Tensor:
    """``PERM[d]`` as an index tensor on ``device`` (sequency position -> block entry), or its
    inverse (block entry -> sequency position); built once per device."""
    perm = torch.tensor(PERM[d], dtype=torch.long)
    if inverse:
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(4 ** d)
        perm = inv
    return perm.to(device)


def fwd_order(iblock: torch.Tensor, d: int) -> torch.Tensor:
    """int32 ``(B, 4^d)`` -> negabinary coefficients in sequency order, as int64 in [0, 2^32)."""
    v = iblock.index_select(1, perm_index(d, str(iblock.device))).to(torch.int64)
    return ((v + NBMASK) & 0xFFFFFFFF) ^ NBMASK


def inv_order(u: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of :func:`fwd_order`: int64 negabinary -> int32 coefficients in block order."""
    v = ((u ^ NBMASK) - NBMASK).to(torch.int32)    # wraps modulo 2^32
    return v.index_select(1, perm_index(d, str(u.device), inverse=True))


__all__ = ["PERM", "perm_index", "maxbits_for", "blocks_per_array", "stream_bytes", "pad_index",
           "to_blocks", "from_blocks", "block_emax", "fwd_cast", "inv_cast", "fwd_xform", "inv_xform",
           "fwd_order", "inv_order"]
