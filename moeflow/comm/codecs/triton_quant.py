"""Fused Triton kernels for the 8-bit codecs (``fp8``, ``fp8-row``, ``int8``) on CUDA tensors.

ScheMoE section 3.1 lists 8-bit payloads. The torch code in :mod:`.fp8` and :mod:`.int8` makes
several passes over a payload (reduce, scale, multiply, cast); here one program per row (or per
group of 128-value blocks of a row) reads its values, reduces them, and writes the bytes and
scales, and decoding is one elementwise pass; :mod:`.fp8` and :mod:`.int8` call these for CUDA
tensors when triton is installed.

Results are bit-identical to the torch codecs on CPU: divisions are correctly rounded
(``tl.math.div_rn``, not Triton's approximate fp32 ``/``), launches pass
``enable_fp_fusion=False`` so a product and a sum round separately as torch's separate ops do,
int8 rounds half to even by adding and subtracting ``2^23``, and bfloat16 inputs are widened by a
bit shift. The float8 e4m3 and bfloat16 roundings are the hardware's ``cvt.rn`` on a GPU; under
``TRITON_INTERPRET=1`` they are instead done in integer arithmetic (``SOFT``, the algorithms of
torch's c10), because the interpreter's own float8 / bfloat16 down-casts do not round to nearest
even. One exception to bit equality: where a row's min (or max) is a zero present with both
signs, int8's ``lo`` (or ``scale``) may be the other zero than torch's, whose ``amin``/``amax``
pick one by position. The hardware e4m3 conversion (``tl.float8e4nv``) exists from compute
capability 8.9 (Ada, Hopper) on; on older GPUs (sm_80 A100, sm_86) the kernels compile the
integer path instead (:func:`hardware_fp8`), same bits. Tested under the interpreter and
compiled for sm_90 (and the integer path for sm_80) without a GPU (``tests/unit/comm/test_triton_quant.py``,
``tests/unit/cuda/test_cuda_review.py``); not yet timed on a GPU.
"""

from __future__ import annotations

import os

import torch

try:                                                     # optional dependency (extra "gpu")
    import triton
    import triton.language as tl
except ImportError:                                      # pragma: no cover
    triton = None
    tl = None

#: Values per block of the ``fp8`` codec (``fp8-row`` scales whole rows).
FP8_BLOCK = 128
#: Largest column tile of the row loops (a power of two).
MAX_TILE = 2048
#: ``fp8`` blocks coded per program (at most).
MAX_GROUP = 8

IN_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def available() -> bool:
    """Whether the Triton kernels can run (triton importable)."""
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    @triton.jit
    def _inverse(scale):
        # 1 / scale, correctly rounded (Triton's plain / is approximate), 0 where scale == 0
        pos = scale > 0.0
        return tl.where(pos, tl.math.div_rn(1.0, tl.where(pos, scale, 1.0)), 0.0)

    @triton.jit
    def _load_f32(ptrs, mask):
        # one tile of the input as float32 (masked lanes 0)
        raw = tl.load(ptrs, mask=mask, other=0.0)
        if raw.dtype == tl.bfloat16:
            # bfloat16 is the top half of a float32: widen by shifting the bits (exact; the
            # interpreter's bf16 -> fp32 conversion mishandles subnormals)
            return (raw.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            return raw.to(tl.float32)                    # exact, or fp64 -> fp32 round to nearest

    @triton.jit
    def _e4m3_soft(v):
        # float32 -> float8 e4m3fn byte in integer arithmetic, as torch's (c10's
        # fp8e4m3fn_from_fp32_value): round to nearest even, saturating: finite magnitudes that
        # round past 448, and inf, -> 448 (0x7E); NaN -> 0x7F; the sign kept
        b = v.to(tl.int32, bitcast=True)
        sign = (b >> 24) & 0x80
        a = b & 0x7FFFFFFF
        # |v| < 2^-6 (e4m3 subnormals, step 2^-9): adding 2^14 rounds |v| to a multiple of 2^-9
        # (float add, nearest even); the low bits of the sum are the code
        f = a.to(tl.float32, bitcast=True) + 16384.0
        sub = f.to(tl.int32, bitcast=True) - (141 << 23)
        # normal: rebias the exponent (127 -> 7) and round the mantissa to 3 bits (add 0x7FFFF
        # plus the lowest kept bit, nearest even), then keep bits 20 and up
        nrm = (a + ((7 - 127) << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
        code = tl.where(a < (121 << 23), sub, tl.minimum(nrm, 0x7E))
        code = tl.where(a >= (1087 << 20), tl.where(a > 0x7F800000, 0x7F, 0x7E), code)
        return (code | sign).to(tl.uint8)

    @triton.jit
    def _e4m3(v, SOFT: tl.constexpr):
        # float32 -> e4m3 byte as torch's .to(torch.float8_e4m3fn): nearest even, saturating
        if SOFT:
            return _e4m3_soft(v)
        else:
            return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)    # cvt.rn.satfinite

    @triton.jit
    def _e4m3_to_f32(q, SOFT: tl.constexpr):
        # e4m3 byte -> float32 (exact)
        if SOFT:
            b = q.to(tl.int32)
            mag = b & 0x7F
            # normal: rebias the exponent (7 -> 127), mantissa to the top of float32's
            nrm = ((mag << 20) + ((127 - 7) << 23)).to(tl.float32, bitcast=True)
            sub = (mag & 7).to(tl.float32) * 0.001953125    # subnormal: mantissa * 2^-9
            f = tl.where(mag >= 8, nrm, sub)
            f = tl.where(mag == 0x7F, float("nan"), f)
            return tl.where(b >= 128, -f, f)
        else:
            return q.to(tl.float8e4nv, bitcast=True).to(tl.float32)

    @triton.jit
    def _store_out(ptrs, y, mask, SOFT: tl.constexpr):
        # store float32 y in the output's dtype (round to nearest even)
        if ptrs.dtype.element_ty == tl.bfloat16:
            if SOFT:
                # c10's round_to_nearest_even: add 0x7FFF plus the lowest kept bit, keep the top
                # 16 bits; NaN -> 0x7FC0
                b = y.to(tl.int32, bitcast=True)
                r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
                r = tl.where(y != y, 0x7FC0, r)
                tl.store(ptrs, r.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
            else:
                tl.store(ptrs, y.to(tl.bfloat16), mask=mask)
        else:
            tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _fp8_block_encode_kernel(x_ptr, q_ptr, s_ptr, cols, nb, x_stride, ngroups,
                                 BLOCK: tl.constexpr, GROUP: tl.constexpr, SOFT: tl.constexpr):
        # program = (row, group of GROUP blocks of BLOCK values); the tile is (GROUP, BLOCK)
        pid = tl.program_id(0)
        row = (pid // ngroups).to(tl.int64)
        blk = (pid % ngroups) * GROUP + tl.arange(0, GROUP)
        col = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        live = (blk[:, None] < nb) & (col < cols)
        x = _load_f32(x_ptr + row * x_stride + col, live)
        # per block: amax of |x| (a partial last block's missing values count as 0),
        # scale = amax / 448, inv = 1 / scale (0 where scale == 0)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.math.div_rn(amax, 448.0)
        inv = _inverse(scale)
        # q = e4m3(x * inv), stored as bytes
        q = _e4m3(x * inv[:, None], SOFT)
        tl.store(q_ptr + row * cols + col, q, mask=live)
        tl.store(s_ptr + row * nb + blk, scale, mask=blk < nb)

    @triton.jit
    def _fp8_row_encode_kernel(x_ptr, q_ptr, s_ptr, cols, x_stride,
                               TILE: tl.constexpr, SOFT: tl.constexpr):
        # program = one row, two passes over it in TILE-wide column tiles
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, TILE)
        # pass 1: amax of |x| over the row
        acc = tl.zeros([TILE], dtype=tl.float32)
        for start in range(0, cols, TILE):
            c = start + offs
            acc = tl.maximum(acc, tl.abs(_load_f32(x_ptr + row * x_stride + c, c < cols)))
        amax = tl.max(acc, axis=0)
        # scale = amax / 448, inv = 1 / scale (0 where scale == 0)
        scale = tl.math.div_rn(amax, 448.0)
        inv = _inverse(scale)
        # pass 2 (from L2): q = e4m3(x * inv), stored as bytes
        for start in range(0, cols, TILE):
            c = start + offs
            m = c < cols
            x = _load_f32(x_ptr + row * x_stride + c, m)
            tl.store(q_ptr + row * cols + c, _e4m3(x * inv, SOFT), mask=m)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _int8_encode_kernel(x_ptr, q_ptr, s_ptr, lo_ptr, cols, x_stride, TILE: tl.constexpr):
        # program = one row, two passes over it in TILE-wide column tiles
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, TILE)
        # pass 1: the row's min and max
        mn = tl.full([TILE], float("inf"), tl.float32)
        mx = tl.full([TILE], float("-inf"), tl.float32)
        for start in range(0, cols, TILE):
            c = start + offs
            m = c < cols
            x = _load_f32(x_ptr + row * x_stride + c, m)
            mn = tl.minimum(mn, tl.where(m, x, float("inf")))
            mx = tl.maximum(mx, tl.where(m, x, float("-inf")))
        lo = tl.min(mn, axis=0)
        hi = tl.max(mx, axis=0)
        # scale = (hi - lo) / 255, inv = 1 / scale (0 where scale == 0)
        scale = tl.math.div_rn(hi - lo, 255.0)
        inv = _inverse(scale)
        # pass 2 (from L2): q = clamp(round_half_even((x - lo) * inv), 0, 255) as uint8;
        # (x - lo) * inv is in [0, 2^23), where adding then subtracting 2^23 rounds it to the
        # nearest integer, ties to even
        for start in range(0, cols, TILE):
            c = start + offs
            m = c < cols
            x = _load_f32(x_ptr + row * x_stride + c, m)
            v = (x - lo) * inv
            r = (v + 8388608.0) - 8388608.0
            r = tl.minimum(tl.maximum(r, 0.0), 255.0)
            tl.store(q_ptr + row * cols + c, r.to(tl.uint8), mask=m)
        tl.store(s_ptr + row, scale)
        tl.store(lo_ptr + row, lo)

    @triton.jit
    def _fp8_decode_kernel(q_ptr, s_ptr, out_ptr, cols, nb, ntiles,
                           BLOCK: tl.constexpr, TILE: tl.constexpr, SOFT: tl.constexpr):
        # program = (row, TILE columns); BLOCK = 0: one scale per row (fp8-row)
        pid = tl.program_id(0)
        row = (pid // ntiles).to(tl.int64)
        c = (pid % ntiles) * TILE + tl.arange(0, TILE)
        m = c < cols
        q = tl.load(q_ptr + row * cols + c, mask=m, other=0)
        if BLOCK == 0:
            s = tl.load(s_ptr + row)
        else:
            s = tl.load(s_ptr + row * nb + c // BLOCK, mask=m, other=0.0)
        # x^ = float32(e4m3 q) * its block's scale, in the output dtype
        _store_out(out_ptr + row * cols + c, _e4m3_to_f32(q, SOFT) * s, m, SOFT)

    @triton.jit
    def _int8_decode_kernel(q_ptr, s_ptr, lo_ptr, out_ptr, cols, ntiles,
                            TILE: tl.constexpr, SOFT: tl.constexpr):
        # program = (row, TILE columns)
        pid = tl.program_id(0)
        row = (pid // ntiles).to(tl.int64)
        c = (pid % ntiles) * TILE + tl.arange(0, TILE)
        m = c < cols
        q = tl.load(q_ptr + row * cols + c, mask=m, other=0)
        s = tl.load(s_ptr + row)
        lo = tl.load(lo_ptr + row)
        # x^ = q * scale + lo, two roundings (no FMA: launched with enable_fp_fusion=False)
        _store_out(out_ptr + row * cols + c, q.to(tl.float32) * s + lo, m, SOFT)


#: First compute capability with hardware float8 e4m3 conversions (``cvt.rn.satfinite.e4m3x2``).
FP8_MIN_CAPABILITY = (8, 9)
_FP8_HW: dict[int, bool] = {}


def hardware_fp8(device: torch.device | str) -> bool:
    """Whether ``device`` converts to float8 e4m3 in hardware (CUDA compute capability >= 8.9),
    cached per device index. Below it ``tl.float8e4nv`` does not compile, so the kernels take
    the integer path (``SOFT``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FP8_HW:
        _FP8_HW[index] = tuple(torch.cuda.get_device_capability(index)) >= FP8_MIN_CAPABILITY
    return _FP8_HW[index]


def _soft(soft_cast: bool | None, device: torch.device | str) -> bool:
    """Whether to round in integer arithmetic: under the interpreter, and on a GPU without
    hardware fp8 (unless ``soft_cast`` says otherwise; ``False`` there is an error)."""
    if soft_cast is None:
        return _interpreting() or not hardware_fp8(device)
    if not soft_cast and not _interpreting() and torch.device(device).type == "cuda" \
            and not hardware_fp8(device):
        raise ValueError(f"soft_cast=False needs hardware float8 (compute capability >= "
                         f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}); {device} has "
                         f"{torch.cuda.get_device_capability(device)}: pass soft_cast=None "
                         "(the integer path, same bits)")
    return soft_cast


def _tile(cols: int) -> int:
    return min(MAX_TILE, max(128, triton.next_power_of_2(max(cols, 1))))


def _rows_input(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.dtype not in IN_DTYPES:
        raise ValueError(f"expected a 2-D float tensor, got {x.dtype} {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def fp8_encode(x: torch.Tensor, block: int | None = FP8_BLOCK,
               soft_cast: bool | None = None) -> list[torch.Tensor]:
    """``(rows, cols)`` float tensor -> ``[q uint8 (rows, cols), scale float32 (rows, nblocks)]``
    as ``_Fp8Base.encode`` (``block=128``: the ``fp8`` codec; ``None``: ``fp8-row``).
    ``soft_cast``: round to e4m3 in integer arithmetic (default: only under the interpreter)."""
    x = _rows_input(x)
    rows, cols = x.shape
    nb = 1 if block is None else max(1, -(-cols // block))
    q = torch.empty(rows, cols, dtype=torch.uint8, device=x.device)
    scale = torch.zeros(rows, nb, dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:                           # nothing to read: scales 0 as torch's
        return [q, scale]
    if block is None:
        tile = _tile(cols)
        _fp8_row_encode_kernel[(rows,)](x, q, scale, cols, x.stride(0), TILE=tile,
                                        SOFT=_soft(soft_cast, x.device),
                                        num_warps=8 if tile > 1024 else 4,
                                        enable_fp_fusion=False)
    else:
        if block != FP8_BLOCK:
            raise ValueError(f"fp8 kernels take blocks of {FP8_BLOCK} values or whole rows")
        group = min(MAX_GROUP, triton.next_power_of_2(nb))
        ngroups = -(-nb // group)
        _fp8_block_encode_kernel[(rows * ngroups,)](x, q, scale, cols, nb, x.stride(0), ngroups,
                                                    BLOCK=block, GROUP=group,
                                                    SOFT=_soft(soft_cast, x.device),
                                                    num_warps=4,
                                                    enable_fp_fusion=False)
    return [q, scale]


def fp8_decode(q: torch.Tensor, scale: torch.Tensor, block: int | None, dtype: torch.dtype,
               soft_cast: bool | None = None) -> torch.Tensor:
    """Inverse of :func:`fp8_encode`, as ``_Fp8Base.decode``: ``(rows, cols)`` of ``dtype``."""
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=dtype, device=q.device)
    if rows == 0 or cols == 0:
        return out
    if block is not None and block != FP8_BLOCK:
        raise ValueError(f"fp8 kernels take blocks of {FP8_BLOCK} values or whole rows")
    q = q.contiguous()
    scale = scale.float().contiguous()
    tile = _tile(cols)
    ntiles = -(-cols // tile)
    _fp8_decode_kernel[(rows * ntiles,)](q, scale, out, cols, scale.shape[1], ntiles,
                                         BLOCK=block or 0, TILE=tile,
                                         SOFT=_soft(soft_cast, q.device),
                                         num_warps=8 if tile > 1024 else 4,
                                         enable_fp_fusion=False)
    return out


def int8_encode(x: torch.Tensor) -> list[torch.Tensor]:
    """``(rows, cols)`` float tensor -> ``[q uint8 (rows, cols), scale (rows, 1), lo (rows, 1)]``
    (float32) as ``Int8Codec.encode``."""
    x = _rows_input(x)
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.uint8, device=x.device)
    scale = torch.zeros(rows, 1, dtype=torch.float32, device=x.device)
    lo = torch.zeros(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:                           # torch's: lo = hi = 0
        return [q, scale, lo]
    tile = _tile(cols)
    _int8_encode_kernel[(rows,)](x, q, scale, lo, cols, x.stride(0), TILE=tile,
                                 num_warps=8 if tile > 1024 else 4, enable_fp_fusion=False)
    return [q, scale, lo]


def int8_decode(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype,
                soft_cast: bool | None = None) -> torch.Tensor:
    """Inverse of :func:`int8_encode`: ``q * scale + lo`` (two roundings) as ``dtype``."""
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=dtype, device=q.device)
    if rows == 0 or cols == 0:
        return out
    q = q.contiguous()
    scale = scale.float().contiguous()
    lo = lo.float().contiguous()
    tile = _tile(cols)
    ntiles = -(-cols // tile)
    _int8_decode_kernel[(rows * ntiles,)](q, scale, lo, out, cols, ntiles, TILE=tile,
                                          # bf16 stores only: hardware on every CUDA GPU
                                          SOFT=_interpreting() if soft_cast is None
                                          else soft_cast,
                                          num_warps=8 if tile > 1024 else 4,
                                          enable_fp_fusion=False)
    return out
