"""ZFP fixed-rate coding of CPU arrays by a compiled per-block coder (numba), for 1-D, 2-D and
3-D blocks: the CPU path of :func:`moeflow.comm.codecs.zfp.compress` / ``decompress``, LLNL
zfp's own loop (Lindstrom 2014, sections 3.1-3.4; the ZFP codec of ScheMoE section 3.1): per
block the header, the transform of :mod:`.numba_simd` and the plane coder of
:mod:`.numba_planes`, read and written in place (zfp's block order and padding). Single-threaded
like zfpy; releases the GIL.

The compiled coders are kept in numba's own cache, in :func:`cache_dir` (a per-user directory
keyed by this environment and this package's sources; the package directory may be read-only).
A cache entry that fails to load warns and is compiled afresh; a coder's first use holds a file
lock, so the ranks of a machine compile it once; each dimensionality's coder has a name of its
own. Why, and what was found about "'descr' is NULL": ``docs/codecs.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import math
import os
import pathlib
import sys
import warnings

import llvmlite
import numba
import numpy as np
import torch
from llvmlite import binding as ll
from numba import njit
from numba.core import caching

from moeflow.comm.codecs.zfp import numba_planes as P
from moeflow.comm.codecs.zfp import transform as T
from moeflow.comm.codecs.zfp.numba_simd import fwd_block, inv_block, inv_block_1d

U64 = np.uint64
I64 = np.int64


_inline = njit(nogil=True, boundscheck=False, inline="always")   # see numba_planes


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


@_inline
def _gather_partial(a, dims, z0, y0, x0, iz, iy, ix, fb):
    """A partial block of ``a`` (one flattened (nz, ny, nx) array) into ``fb``, read through
    ``iz``, ``iy``, ``ix``, which map padded to source coordinates (zfp's padding of partial
    blocks, :func:`.transform.pad_index`)."""
    for i in range(fb.shape[0]):
        z, y, x = i >> 4, (i >> 2) & 3, i & 3
        fb[i] = a[(iz[z0 + z] * dims[1] + iy[y0 + y]) * dims[2] + ix[x0 + x]]


@_inline
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


def _build(d: int, which: int):
    """The encoder (``which=0``) or decoder (1) of ``d``-D blocks, compiled with ``d`` a
    constant, so that the block functions inline into one dimensionality's loop. Its closure
    holds only ``d`` and ``S``, plain values (numba keys its cache by the closure's contents)."""
    S = 4 ** d

    def encode(a, dims, maxbits, nws, iz, iy, ix, table):
        """float32 ``a`` (nslices, nz * ny * nx), each row a row-major (nz, ny, nx) = ``dims``
        array -> uint64 words ``(nslices, nws)``: each slice's blocks in zfp's order,
        ``maxbits`` bits each."""
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

    def decode(words, dims, maxbits, out, single, many):
        """uint64 words ``(nslices, nws)`` -> float32 ``out`` (nslices, nz * ny * nx)."""
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

    fn = (encode, decode)[which]
    fn.__name__ = fn.__qualname__ = f"{fn.__name__}_{d}d"   # a name per coder (module notes)
    disp = njit(nogil=True, boundscheck=False)(fn)
    try:
        disp._cache = _Cache(fn)                          # numba's cache, with our locator
    except RuntimeError as exc:                           # no writable cache directory
        _warn_once(f"zfp: cannot write the numba cache in {cache_dir()} ({exc}); every process "
                   "compiles the coder (6-10 s per dimensionality); choose a writable "
                   "directory with moeflow.comm.codecs.zfp.numba_backend.set_cache_dir(path)")
    return disp


# ---------------------------------------------------------------------- the on-disk cache

_root: pathlib.Path | None = None                         # set_cache_dir's override
_coders: dict[tuple[int, int], object] = {}               # (d, which) -> loaded dispatcher


def set_cache_dir(path) -> None:
    """Cache the compiled coders under ``path`` (None: the default, see :func:`cache_dir`).
    Coders this process already loaded are dropped: the next call loads or compiles them
    there."""
    global _root
    _root = None if path is None else pathlib.Path(path)
    _coders.clear()


def cache_dir() -> pathlib.Path:
    """Where this environment's compiled coders live: ``<root>/<key>``, the root being
    :func:`set_cache_dir`'s, else numba's ``NUMBA_CACHE_DIR`` + ``/moeflow``, else
    ``$XDG_CACHE_HOME/moeflow/numba`` (``~/.cache/moeflow/numba``)."""
    root = _root
    if root is None and numba.config.CACHE_DIR:
        root = pathlib.Path(numba.config.CACHE_DIR) / "moeflow"
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
        root = pathlib.Path(xdg) / "moeflow" / "numba"
    return root / env_key(pathlib.Path(__file__).parent)


@functools.lru_cache(maxsize=None)
def env_key(package: pathlib.Path) -> str:
    """Name of the cache directory of this environment: Python's cache tag and numba's version,
    then a hash of the Python, numba, llvmlite and numpy versions, the CPU (as LLVM names it and
    its features) and the sources of ``package`` (every ``.py`` file: code is inlined across
    them, and numba itself checks only the defining file)."""
    h = hashlib.sha256("|".join([sys.version, numba.__version__, llvmlite.__version__,
                                 np.__version__, ll.get_host_cpu_name(),
                                 ll.get_host_cpu_features().flatten()]).encode())
    for f in sorted(package.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return f"{sys.implementation.cache_tag}-numba{numba.__version__}-{h.hexdigest()[:16]}"


class _Locator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """numba cache locator: this package's coders live in :func:`cache_dir`."""

    def __init__(self, py_func, py_file):
        self._py_file, self._lineno = py_file, py_func.__code__.co_firstlineno

    def get_cache_path(self):
        return str(cache_dir())


class _Impl(caching.CompileResultCacheImpl):
    _locator_classes = [_Locator]


class _Cache(caching.FunctionCache):
    """numba's function cache, except that a load that fails for any reason (a damaged file, a
    foreign one) warns and returns nothing: numba then compiles afresh and overwrites it."""

    _impl_class = _Impl

    def load_overload(self, sig, target_context):
        try:
            return super().load_overload(sig, target_context)
        except Exception as exc:                          # noqa: BLE001 - any damage at all
            _warn_once(f"zfp: the compiled coder cached in {self.cache_path} could not be "
                       f"loaded ({type(exc).__name__}: {exc}); compiling it afresh")
            return None

    def save_overload(self, sig, data):
        try:
            try:
                super().save_overload(sig, data)
            except Exception:                             # noqa: BLE001 - a damaged index:
                self._cache_file.flush()                  # start it afresh
                super().save_overload(sig, data)
        except Exception as exc:                          # noqa: BLE001
            _warn_once(f"zfp: could not save the compiled coder in {self.cache_path} "
                       f"({type(exc).__name__}: {exc}); the next process compiles it again")


def _warn_once(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def _machine_lock(name: str):
    """Held while a coder is first loaded or compiled in this process: the ranks of one
    machine compile it once, the others wait and then load it from the cache."""
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        f = open(cache_dir() / f"{name}.lock", "a")
    except OSError:                                       # no cache: each process compiles
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:                                   # a file system without locks
            pass
        yield


def _run(d: int, which: int, *args):
    """Call the encoder (``which=0``) or decoder (1) of ``d``-D blocks: loaded from the cache
    or compiled, under the machine-wide lock, on its first call in this process."""
    fn = _coders.get((d, which))
    if fn is None:
        fn = _build(d, which)
        with _machine_lock(fn.py_func.__name__):
            out = fn(*args)
        _coders[(d, which)] = fn
        return out
    return fn(*args)


# -------------------------------------------------------------------------------- entry


def _zyx(shape: tuple[int, ...], d: int) -> tuple[int, int, int]:
    """(nz, ny, nx) of the zfp arrays in the last ``d`` dims of ``shape`` (1 for absent axes)."""
    return (1,) * (3 - d) + tuple(int(n) for n in shape[len(shape) - d:])


def compress(a: torch.Tensor, d: int, maxbits: int) -> torch.Tensor:
    """float32 CPU array; its last ``d`` dims form one zfp array per leading index -> uint8
    ``(*lead, nbytes)``: each slice's own zfp stream (``bitplane.compress``'s bytes)."""
    lead = a.shape[: a.dim() - d]
    dims = _zyx(tuple(a.shape), d)
    rows = a.detach().contiguous().reshape(-1, math.prod(dims)).numpy()
    nws = -(-T.blocks_per_array(a.shape, d) * maxbits // 64)
    words = _run(d, 0, rows, dims, maxbits, nws, *_pad_indices(dims), P.tables()[0])
    return torch.from_numpy(words).view(torch.uint8).reshape(*lead, nws * 8)


def decompress(data: torch.Tensor, shape: tuple[int, ...], d: int, maxbits: int) -> torch.Tensor:
    """Inverse of :func:`compress`: uint8 streams -> float32 array of ``shape``."""
    nbytes = data.shape[-1]
    rows = data.reshape(-1, nbytes).contiguous()
    if rows.storage_offset() % 8:                         # uint64 view needs 8-byte alignment
        rows = rows.clone()
    dims = _zyx(tuple(shape), d)
    out = np.empty((rows.shape[0], math.prod(dims)), dtype=np.float32)
    _run(d, 1, rows.numpy().view(np.uint64), dims, maxbits, out, *P.tables()[1:])
    return torch.from_numpy(out).reshape(shape)


@functools.lru_cache(maxsize=64)
def _pad_indices(dims: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per axis (z, y, x), the source coordinate of each padded coordinate (zfp's padding)."""
    return tuple(T.pad_index(n, "cpu").numpy() for n in dims)


__all__ = ["cache_dir", "compress", "decompress", "env_key", "set_cache_dir"]
