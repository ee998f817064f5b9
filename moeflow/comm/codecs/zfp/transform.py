"""ZFP's block transform, shared by every back end (Lindstrom 2014, "Fixed-rate compressed
floating-point arrays", sections 3.1-3.3; the ZFP codec of ScheMoE section 3.1).

A d-dimensional array is cut into blocks of ``4^d`` values (partial blocks padded the way LLNL
zfp pads them); each float32 block becomes integers:

1. block-floating-point: ``emax`` is the exponent (as ``frexp`` gives it) of the block's largest
   magnitude; every value becomes the 32-bit integer ``trunc(x * 2^(30 - emax))``;
2. the decorrelating forward lifting transform (zfp's non-orthogonal 4-point transform), along
   x, then y, then z;
3. the coefficients are reordered by total sequency (``perm``) and mapped to negabinary
   (``(v + 0xaaaaaaaa) ^ 0xaaaaaaaa``), so that their bit planes can be coded from the top.

Decoding runs the same steps backwards. Integer arithmetic wraps at 32 bits, as zfp's does; the
float steps round exactly as zfp's single-precision C code does (IEEE, no flush to zero),
including what it does for inputs zfp declares unsupported (see ``docs/codecs.md``).
"""

from __future__ import annotations

import functools

import torch

NBMASK = 0xAAAAAAAA
EBITS = 8
EBIAS = 127
INT_MIN = -(1 << 31)


def _perm(d: int) -> list[int]:
    """Coefficient order of a ``4^d`` block: by ``i+j+k``, then ``i^2+j^2+k^2``, ties as zfp."""
    if d == 1:
        return [0, 1, 2, 3]
    if d == 2:
        order = [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (0, 2), (2, 1), (1, 2), (3, 0), (0, 3),
                 (2, 2), (3, 1), (1, 3), (3, 2), (2, 3), (3, 3)]
        return [i + 4 * j for i, j in order]
    order = [(0, 0, 0),
             (1, 0, 0), (0, 1, 0), (0, 0, 1),
             (0, 1, 1), (1, 0, 1), (1, 1, 0), (2, 0, 0), (0, 2, 0), (0, 0, 2),
             (1, 1, 1), (2, 1, 0), (2, 0, 1), (0, 2, 1), (1, 2, 0), (1, 0, 2), (0, 1, 2),
             (3, 0, 0), (0, 3, 0), (0, 0, 3),
             (2, 1, 1), (1, 2, 1), (1, 1, 2), (0, 2, 2), (2, 0, 2), (2, 2, 0),
             (3, 1, 0), (3, 0, 1), (0, 3, 1), (1, 3, 0), (1, 0, 3), (0, 1, 3),
             (1, 2, 2), (2, 1, 2), (2, 2, 1), (3, 1, 1), (1, 3, 1), (1, 1, 3),
             (3, 2, 0), (3, 0, 2), (0, 3, 2), (2, 3, 0), (2, 0, 3), (0, 2, 3),
             (2, 2, 2), (3, 2, 1), (3, 1, 2), (1, 3, 2), (2, 3, 1), (2, 1, 3), (1, 2, 3),
             (0, 3, 3), (3, 0, 3), (3, 3, 0),
             (3, 2, 2), (2, 3, 2), (2, 2, 3), (1, 3, 3), (3, 1, 3), (3, 3, 1),
             (2, 3, 3), (3, 2, 3), (3, 3, 2),
             (3, 3, 3)]
    return [i + 4 * (j + 4 * k) for i, j, k in order]


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
    if d == 1:
        b = a.reshape(-1, nb[0], 4)
    elif d == 2:
        b = a.reshape(-1, nb[0], 4, nb[1], 4).permute(0, 1, 3, 2, 4)
    else:
        b = a.reshape(-1, nb[0], 4, nb[1], 4, nb[2], 4).permute(0, 1, 3, 5, 2, 4, 6)
    return b.reshape(-1, 4 ** d)


def from_blocks(b: torch.Tensor, shape: tuple[int, ...], d: int) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: drop the padding of partial blocks."""
    lead, dims = tuple(shape[: len(shape) - d]), tuple(shape[len(shape) - d:])
    nb = [-(-n // 4) for n in dims]
    if d == 1:
        a = b.reshape(-1, nb[0] * 4)
    elif d == 2:
        a = b.reshape(-1, nb[0], nb[1], 4, 4).permute(0, 1, 3, 2, 4).reshape(-1, nb[0] * 4,
                                                                            nb[1] * 4)
    else:
        a = (b.reshape(-1, nb[0], nb[1], nb[2], 4, 4, 4).permute(0, 1, 4, 2, 5, 3, 6)
             .reshape(-1, nb[0] * 4, nb[1] * 4, nb[2] * 4))
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


__all__ = ["PERM", "perm_index", "maxbits_for", "blocks_per_array", "pad_index", "to_blocks",
           "from_blocks", "block_emax", "fwd_cast", "inv_cast", "fwd_xform", "inv_xform",
           "fwd_order", "inv_order"]
