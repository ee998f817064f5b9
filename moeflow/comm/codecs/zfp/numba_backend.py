"""ZFP fixed-rate coding of CPU arrays by a compiled per-block coder (numba), for 1-D, 2-D and
3-D blocks: the CPU path of :func:`moeflow.comm.codecs.zfp.compress` / ``decompress``.

This is LLNL zfp's own algorithm, block by block, as its C code runs it (Lindstrom 2014,
"Fixed-rate compressed floating-point arrays"; the ZFP codec of ScheMoE section 3.1):

- header (section 3.1): one bit "block is nonzero", then the biased common exponent
  ``emax + 127`` in 8 bits; an all-zero block is the single bit 0;
- block-floating-point cast ``trunc(x * 2^(30 - emax))`` in float32 (section 3.1), the
  decorrelating lifting transform along x, y, z (section 3.2), the total-sequency reordering
  and negabinary mapping (section 3.3), exactly as :mod:`.transform` documents them (32-bit
  wrapping integers, zfp's rounding, inf/NaN as zfp's x86 code treats them): one block in one
  LLVM vector (:mod:`.numba_simd`);
- the embedded coder (section 3.4, :mod:`.numba_planes`): bit planes from the top, the first
  ``n`` bits of a plane verbatim, then group tests with unary run lengths, until exactly
  ``maxbits`` bits are written; the stream is zero padded to ``maxbits``.

Blocks are read from and written to the array in place (zfp's block order: z slowest, x
fastest); a partial block at an edge is padded as zfp pads it (:func:`.transform.pad_index`)
and only its in-range values are written back.

Why compiled: vectorized torch runs one tensor op per step across all blocks; the torch coders
(:mod:`.group_encode` for 1-D, :mod:`.plane_encode` / :mod:`.plane_decode` for 2-D/3-D)
measured 0.8-1.3x and 0.11-0.21x of zfpy's single C loop. They remain for other devices, for
CPUs without numba, and as this coder's cross-check (``tests/test_zfp_numba.py``).

Streams are zfp's: 64-bit little-endian words, LSB first, each slice's blocks back to back and
padded to a whole word. The coder is single-threaded (as zfpy is) and releases the GIL.
Compiled code is cached on disk by numba (first use compiles each dimensionality once).
"""

from __future__ import annotations

import functools
import hashlib
import math
import pathlib

import numpy as np
import torch

from moeflow.comm.codecs.zfp import transform as T

try:
    import numba
    from numba import njit

    from moeflow.comm.codecs.zfp import numba_planes as P, numba_simd
    from moeflow.comm.codecs.zfp.numba_simd import fwd_block, inv_block, inv_block_1d
except ImportError:                          # pragma: no cover - zfp then uses the torch coders
    numba = None

U64 = np.uint64
I64 = np.int64


def available() -> bool:
    """Whether numba is installed (otherwise CPU tensors use the vectorized torch coders)."""
    return numba is not None


if numba is not None:
    _jit = njit(cache=True, nogil=True, boundscheck=False)
    _inline = njit(cache=True, nogil=True, boundscheck=False, inline="always")  # see numba_planes

    @_inline
    def _pow2(e):
        """float32 ``2^e`` as ``ldexpf(1, e)`` gives it (0 below 2^-149, inf above 2^127)."""
        if -126 <= e <= 127:
            return np.int32((e + 127) << 23).view(np.float32)
        return np.float32(math.ldexp(1.0, e))

    @_inline
    def _emax(bits):
        """Exponent of a block (``bits``: its float32 bit patterns) as
        :func:`.transform.block_emax` computes it (NaN skipped; -127 for an all-zero block; 0
        for an infinite maximum)."""
        amax = 0
        for i in range(bits.shape[0]):                    # branch-free, so it vectorizes
            a = I64(bits[i]) & 0x7FFFFFFF
            amax = max(amax, a if a <= 0x7F800000 else 0)  # NaN (above inf's bits) skipped
        if amax == 0:
            return -127
        be = amax >> 23
        if be == 0xFF:
            return 0
        return max(be - 126, -126)

    @_jit
    def _gather_partial(a, dims, z0, y0, x0, iz, iy, ix, fb):
        """A partial block of ``a`` (one flattened (nz, ny, nx) array) into ``fb``, read through
        ``iz``, ``iy``, ``ix``, which map padded to source coordinates (zfp's padding of partial
        blocks, :func:`.transform.pad_index`)."""
        for i in range(fb.shape[0]):
            z, y, x = i >> 4, (i >> 2) & 3, i & 3
            fb[i] = a[(iz[z0 + z] * dims[1] + iy[y0 + y]) * dims[2] + ix[x0 + x]]

    @_jit
    def _scatter_partial(fb, out, dims, z0, y0, x0):
        """The in-range values of a partial block ``fb`` into ``out`` (one flattened array);
        the padding is dropped, as zfp does."""
        for i in range(fb.shape[0]):
            z, y, x = z0 + (i >> 4), y0 + ((i >> 2) & 3), x0 + (i & 3)
            if z < dims[0] and y < dims[1] and x < dims[2]:
                out[(z * dims[1] + y) * dims[2] + x] = fb[i]

    @_inline
    def _block_bases(d, dims):
        """Per block of one array, in zfp's order (z slowest, x fastest): the offset of its
        first value, or -1 for a partial block at an edge (it goes through zfp's padding,
        :func:`_block_corner` gives its first coordinate)."""
        nz, ny, nx = dims
        bases = np.empty((nz + 3) // 4 * ((ny + 3) // 4) * ((nx + 3) // 4), dtype=np.int64)
        b = 0
        for z0 in range(0, nz, 4):
            for y0 in range(0, ny, 4):
                for x0 in range(0, nx, 4):
                    full = x0 + 4 <= nx and (d < 2 or y0 + 4 <= ny) and (d < 3 or z0 + 4 <= nz)
                    bases[b] = (z0 * ny + y0) * nx + x0 if full else -1
                    b += 1
        return bases

    @_inline
    def _block_corner(dims, b):
        """First coordinate (z0, y0, x0) of block ``b`` (zfp's order)."""
        nbx = (dims[2] + 3) // 4
        nby = (dims[1] + 3) // 4
        return 4 * (b // (nbx * nby)), 4 * (b // nbx % nby), 4 * (b % nbx)

    @_inline
    def _row_offsets(d, dims):
        """Offset of the block's row ``j`` (4 values along x; y, then z, is j's order) from
        the block's first value in a row-major (nz, ny, nx) array."""
        off = np.empty(1 << (2 * d - 2), dtype=np.int64)
        for j in range(off.shape[0]):
            off[j] = ((j >> 2) * dims[1] + (j & 3)) * dims[2]
        return off

    @_inline
    def _encode_block(fb, d, maxbits, words, pos, u, table):
        """Code the float32 block ``fb`` into ``words`` at bit ``pos`` (``u``: scratch;
        ``table``: the 1-D encoder table)."""
        emax = _emax(fb.view(np.int32))
        e = emax + 127
        if e == 0:                                        # all zero: one 0 bit, then padding
            return
        P.put(words, pos, U64(2 * e + 1), 9)
        fwd_block(fb, _pow2(30 - emax), u, d)             # sections 3.1-3.3 (vector code)
        if d == 1:                                        # section 3.4
            P.encode_planes_1d(u, maxbits - 9, words, pos + 9, table)
        else:
            P.encode_planes(u, 1 << (2 * d), maxbits - 9, words, pos + 9)

    @_inline
    def _decode_block(words, pos, d, maxbits, out, u, single, many):
        """Decode the block at bit ``pos`` into float32 ``out`` (``u``: scratch; ``single``,
        ``many``: the 1-D decoder tables)."""
        head = P.window(words, pos)
        if head & U64(1) == 0:
            for i in range(1 << (2 * d)):
                out[i] = 0.0
            return
        s = _pow2(I64((head >> U64(1)) & U64(0xFF)) - 127 - 30)
        if d == 1:                                        # section 3.4, then sections
            lo, hi = P.decode_planes_1d(words, pos, 9, maxbits - 9, single, many)
            inv_block_1d(lo, hi, s, out)                  # 3.3-3.1 inverted (vector code)
        else:
            P.decode_planes(words, pos + 9, 1 << (2 * d), maxbits - 9, u)
            inv_block(u, s, out, d)


def _build(d: int, stamp: str):
    """The encoder and decoder of ``d``-D blocks, compiled with ``d`` a constant, so that the
    block functions inline into one dimensionality's loop.

    Their closures hold only ``d`` and ``stamp`` (plain values: numba keys its on-disk cache
    by the closure's contents, so they must pickle the same in every process). ``stamp`` hashes
    the sources of :mod:`.numba_planes` and :mod:`.numba_simd`, whose code is inlined here:
    numba only checks the defining file's time stamp, so without it an edit there would leave
    a stale cached coder."""
    S = 4 ** d

    @_jit
    def encode(a, dims, maxbits, nws, iz, iy, ix, table):
        """float32 ``a`` (nslices, nz * ny * nx), each row a row-major (nz, ny, nx) = ``dims``
        array -> uint64 words ``(nslices, nws)``: each slice's blocks in zfp's order,
        ``maxbits`` bits each."""
        stamp                     # noqa: B018 - referenced so the cache key holds it (above)
        bases = _block_bases(d, dims)
        off = _row_offsets(d, dims)
        words = np.zeros((a.shape[0], nws), dtype=np.uint64)
        fb = np.empty(S, dtype=np.float32)
        u = np.empty(S, dtype=np.uint32)
        for s in range(a.shape[0]):
            row = a[s]
            ws = words[s]
            for b in range(bases.shape[0]):
                base = bases[b]
                if base >= 0:
                    for j in range(S // 4):
                        for x in range(4):
                            fb[4 * j + x] = row[base + off[j] + x]
                else:
                    z0, y0, x0 = _block_corner(dims, b)
                    _gather_partial(row, dims, z0, y0, x0, iz, iy, ix, fb)
                _encode_block(fb, d, maxbits, ws, b * maxbits, u, table)
        return words

    @_jit
    def decode(words, dims, maxbits, out, single, many):
        """uint64 words ``(nslices, nws)`` -> float32 ``out`` (nslices, nz * ny * nx)."""
        stamp                     # noqa: B018
        bases = _block_bases(d, dims)
        off = _row_offsets(d, dims)
        fb = np.empty(S, dtype=np.float32)
        u = np.empty(S, dtype=np.uint32)
        for s in range(out.shape[0]):
            row = out[s]
            ws = words[s]
            for b in range(bases.shape[0]):
                _decode_block(ws, b * maxbits, d, maxbits, fb, u, single, many)
                base = bases[b]
                if base >= 0:
                    for j in range(S // 4):
                        for x in range(4):
                            row[base + off[j] + x] = fb[4 * j + x]
                else:
                    z0, y0, x0 = _block_corner(dims, b)
                    _scatter_partial(fb, row, dims, z0, y0, x0)
        return out

    return encode, decode


@functools.lru_cache(maxsize=None)
def _coder(d: int):
    """(encode, decode) for ``d``-D blocks, built on first use."""
    stamp = hashlib.sha256(b"".join(pathlib.Path(m.__file__).read_bytes()
                                    for m in (P, numba_simd))).hexdigest()
    return _build(d, stamp)


def _zyx(shape: tuple[int, ...], d: int) -> tuple[int, int, int]:
    """(nz, ny, nx) of the zfp arrays in the last ``d`` dims of ``shape`` (1 for absent axes)."""
    return (1,) * (3 - d) + tuple(int(n) for n in shape[len(shape) - d:])


def compress(a: torch.Tensor, d: int, maxbits: int) -> torch.Tensor:
    """float32 CPU array; its last ``d`` dims form one zfp array per leading index -> uint8
    ``(*lead, nbytes)``: each slice's own zfp stream (``torch_backend.compress``'s bytes)."""
    _require()
    lead = a.shape[: a.dim() - d]
    dims = _zyx(tuple(a.shape), d)
    rows = a.detach().contiguous().reshape(-1, math.prod(dims)).numpy()
    nws = -(-T.blocks_per_array(a.shape, d) * maxbits // 64)
    words = _coder(d)[0](rows, dims, maxbits, nws, *_pad_indices(dims), P.tables()[0])
    return torch.from_numpy(words).view(torch.uint8).reshape(*lead, nws * 8)


def decompress(data: torch.Tensor, shape: tuple[int, ...], d: int, maxbits: int) -> torch.Tensor:
    """Inverse of :func:`compress`: uint8 streams -> float32 array of ``shape``."""
    _require()
    nbytes = data.shape[-1]
    rows = data.reshape(-1, nbytes).contiguous()
    if rows.storage_offset() % 8:                         # uint64 view needs 8-byte alignment
        rows = rows.clone()
    dims = _zyx(tuple(shape), d)
    out = np.empty((rows.shape[0], math.prod(dims)), dtype=np.float32)
    _coder(d)[1](rows.numpy().view(np.uint64), dims, maxbits, out, *P.tables()[1:])
    return torch.from_numpy(out).reshape(shape)


@functools.lru_cache(maxsize=64)
def _pad_indices(dims: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per axis (z, y, x), the source coordinate of each padded coordinate (zfp's padding)."""
    return tuple(T.pad_index(n, "cpu").numpy() for n in dims)


def _require() -> None:
    if numba is None:
        raise RuntimeError("zfp.numba_backend needs numba (pip install 'numba>=0.59'); "
                           "zfp.compress/decompress fall back to the torch coders without it")


__all__ = ["available", "compress", "decompress"]
