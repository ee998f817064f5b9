"""Run by tests/unit/comm/test_triton_quant.py in a subprocess with TRITON_INTERPRET=1 (Triton's own CPU
interpreter, which must be set before the kernels are defined): the fused 8-bit codec kernels of
``moeflow.comm.codecs.triton_quant`` against the torch code of the ``fp8``, ``fp8-row`` and
``int8`` codecs, bit for bit (payload bytes, scales, offsets, decoded values).

The launchers are called directly on CPU tensors (the codecs send only CUDA tensors to them).
The interpreter's float32 -> float8 e4m3 and float32 -> bfloat16 casts do not round to nearest
even, so by default (under the interpreter) the kernels round in integer arithmetic (``SOFT``);
that rounding is checked on many values against torch's casts, and the payloads against the
codecs. The hardware-cast path (``soft_cast=False``, what a GPU runs: ``cvt.rn``) is checked
too, except for the cast instruction itself: its bytes must equal the interpreter's cast of
torch's own scaled values, and its decode must equal torch's for float32/float16/float64
outputs. With ``--compile`` (and without TRITON_INTERPRET) it instead compiles every kernel for
sm_90, which needs no GPU, and checks the PTX for correctly rounded divisions, no FMA, and the
e4m3 / bf16 round-to-nearest-even conversions."""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from moeflow.comm.codecs import CODECS
from moeflow.comm.codecs import triton_quant as tq
from moeflow.comm.codecs.triton_quant import _e4m3, _e4m3_to_f32, _store_out

FP8 = [("fp8", 128), ("fp8-row", None)]
FLOATS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
          torch.bfloat16: torch.int16}


@triton.jit
def _cast_kernel(v_ptr, out_ptr, n, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    # float32 -> e4m3 byte, as the encode kernels round
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, _e4m3(tl.load(v_ptr + i, mask=m, other=0.0), SOFT), mask=m)


@triton.jit
def _uncast_kernel(q_ptr, out_ptr, n, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    # e4m3 byte -> float32 into out's dtype, as the decode kernels do
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    f = _e4m3_to_f32(tl.load(q_ptr + i, mask=m, other=0), SOFT)
    _store_out(out_ptr + i, f, m, SOFT)


@triton.jit
def _store_kernel(v_ptr, out_ptr, n, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    # float32 -> out's dtype, as the decode kernels store
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    _store_out(out_ptr + i, tl.load(v_ptr + i, mask=m, other=0.0), m, SOFT)


def _run(kernel, src: torch.Tensor, out_dtype: torch.dtype, soft: bool) -> torch.Tensor:
    from tests.helpers import triton_checks

    dev = triton_checks.DEVICE                           # cpu (interpreter) or cuda
    src = src.to(dev)
    out = torch.empty(src.numel(), dtype=out_dtype, device=dev)
    block = 1 << 16
    kernel[(triton.cdiv(src.numel(), block),)](src, out, src.numel(), SOFT=soft, BLOCK=block)
    return out.cpu()


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits, NaNs (of any sign or payload) at the same places."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    it = FLOATS[a.dtype]
    return torch.equal(a.view(it)[~nan], b.view(it)[~nan])


def _bad(a: torch.Tensor, b: torch.Tensor) -> list:
    ne = (a.view(FLOATS.get(a.dtype, a.dtype)) != b.view(FLOATS.get(b.dtype, b.dtype)))
    return ne.nonzero()[:4].tolist()


# ---------------------------------------------------------------------------------- the casts

def _e4m3_grid() -> torch.Tensor:
    """The 127 finite non-negative e4m3 values, increasing (0x00 .. 0x7E)."""
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _cast_inputs(g) -> torch.Tensor:
    grid = _e4m3_grid()
    mid = (grid[1:] + grid[:-1]) / 2                     # exact ties (nearest even decides)
    near = torch.cat([torch.nextafter(mid, torch.tensor(-1.0)),
                      torch.nextafter(mid, torch.tensor(1e9))])
    mags = torch.exp2(torch.empty(20000).uniform_(-16, 9.5, generator=g))  # subnormal to 724
    special = torch.tensor([0.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -9, 2.0 ** -6, 1e-45, 1e-40,
                            448.0, 455.0, 456.0, 460.0, 464.0, 464.00003, 470.0, 479.99997,
                            480.0, 1e30, float("inf"), float("nan")])
    v = torch.cat([grid, mid, near, mags, special])
    return torch.cat([v, -v])


def check_casts(g) -> None:
    """The kernels' roundings against torch's casts, on many values."""
    # float32 -> e4m3: ties, their neighbours, random magnitudes from below e4m3's subnormals
    # to beyond 448, zeros, inf, NaN
    v = _cast_inputs(g)
    want = v.to(torch.float8_e4m3fn).view(torch.uint8)
    got = _run(_cast_kernel, v, torch.uint8, soft=True)
    assert torch.equal(got, want), ("e4m3 soft cast", v[got != want][:4].tolist())
    # e4m3 -> float32 (all 256 bytes; 0x7F / 0xFF are NaN)
    q = torch.arange(256, dtype=torch.uint8)
    want = q.view(torch.float8_e4m3fn).float()
    assert _same_floats(_run(_uncast_kernel, q, torch.float32, soft=True), want), "e4m3 -> f32"
    # the hardware path's e4m3 -> float32 is exact under the interpreter too, except for the
    # two NaN bytes (the interpreter decodes them as 480)
    hw = _run(_uncast_kernel, q, torch.float32, soft=False)
    ok = (q & 0x7F) != 0x7F
    assert torch.equal(hw[ok].view(torch.int32), want[ok].view(torch.int32)), "e4m3 -> f32 hw"
    # float32 -> bfloat16: random bit patterns (every exponent), exact ties of both parities,
    # values rounding to inf; NaN -> NaN
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (20000,), generator=g, dtype=torch.int64)
    bits = bits.to(torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000
    big = torch.tensor([3.3895314e38, 3.3961776e38, 3.4028235e38, float("inf"), float("nan")])
    v = torch.cat([bits.view(torch.float32), ties.view(torch.float32), big, -big])
    got = _run(_store_kernel, v, torch.bfloat16, soft=True)
    want = v.to(torch.bfloat16)
    assert _same_floats(got, want), ("bf16 soft cast", _bad(got, want))


# ------------------------------------------------------------------------------- the payloads

def _rows(g, rows: int, cols: int) -> torch.Tensor:
    """Gaussian rows of very different scales (1e-3 to 1e3, and random spread)."""
    scales = torch.tensor([1e-3, 1.0, 1e3])[torch.arange(rows) % 3, None]
    return torch.randn(rows, cols, generator=g) * scales * torch.exp(torch.randn(rows, 1,
                                                                               generator=g))


def _mixed(g, cols: int = 300, big: float = 1e30, small: float = 1e-20) -> torch.Tensor:
    """Zeros, -0.0, constants, huge and tiny rows, one outlier (``big`` and ``small`` such that
    the row stays finite and has no zero of both signs as its min or max in the payload's
    dtype: see check_signed_zeros)."""
    x = torch.randn(8, cols, generator=g)
    x[0] = 0.0
    x[1] = 2.5                                           # constant
    x[2] = -7.0
    x[3] = -0.0                                          # all negative zeros
    x[4] *= big
    x[5, 17] = 1e4                                       # one outlier
    x[6] *= small
    x[7, : cols // 2] = 0.0                              # zeros and values in one row
    return x


def _fp8_tiny(g, cols: int = 300) -> torch.Tensor:
    """Blocks whose amax / 448 is subnormal or underflows (1 / scale = inf): torch's codec
    writes +-448 and NaN bytes there; the kernels the same."""
    x = torch.randn(3, cols, generator=g)
    x[0] *= 1e-37
    x[1] *= 1e-41                                        # float32 subnormals
    x[2] *= 3e-36
    x[2, :5] = 0.0
    return x


def _fp8_ties(g) -> torch.Tensor:
    """Every 128-value block holds 448 (so scale = 1, inv = 1) and e4m3 midpoints, exact ties
    for the cast, with their neighbours; one row for the codec to take whole."""
    grid = _e4m3_grid()
    mid = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([mid, -mid, torch.nextafter(mid, torch.tensor(1e9)),
                   torch.nextafter(-mid, torch.tensor(-1e9))])
    v = v[torch.randperm(v.numel(), generator=g)]
    nb = -(-v.numel() // 127)
    v = torch.cat([v, torch.zeros(nb * 127 - v.numel())]).view(nb, 127)
    return torch.cat([torch.full((nb, 1), 448.0), v], dim=1).reshape(1, -1)


def _int8_ties(g) -> torch.Tensor:
    """min 0, max 255 (so scale = 1): k + 0.5 are exact ties of the rounding."""
    k = torch.arange(255, dtype=torch.float32)
    v = torch.cat([k + 0.5, torch.nextafter(k + 0.5, torch.tensor(0.0)), k])
    v = v[torch.randperm(v.numel(), generator=g)]
    return torch.cat([torch.tensor([0.0, 255.0]), v]).reshape(1, -1)


def _check_encode(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape, a.dtype)
        if a.dtype == torch.uint8:
            assert torch.equal(a, b), (what, f"payload {i} bytes differ at", _bad(a, b))
        else:
            assert _same_floats(a, b), (what, f"payload {i} differs at", _bad(a, b))


def _check_decode(codec, payloads: list, got: torch.Tensor, dtype, what: str) -> None:
    want = codec.decode(payloads, dtype)
    assert _same_floats(got, want), (what, "decode", dtype, _bad(got, want))


def check_fp8(x: torch.Tensor, what: str, out_dtypes=None) -> None:
    for name, block in FP8:
        codec = CODECS[name]()
        want = codec.encode(x)
        got = tq.fp8_encode(x, block)
        _check_encode(got, want, f"{name} {what}")
        for dtype in out_dtypes or [x.dtype]:
            _check_decode(codec, want, tq.fp8_decode(*want, block, dtype), dtype,
                          f"{name} {what}")


def check_int8(x: torch.Tensor, what: str, out_dtypes=None) -> None:
    codec = CODECS["int8"]()
    want = codec.encode(x)
    _check_encode(tq.int8_encode(x), want, f"int8 {what}")
    for dtype in out_dtypes or [x.dtype]:
        _check_decode(codec, want, tq.int8_decode(*want, dtype), dtype, f"int8 {what}")


def check_signed_zeros(g) -> None:
    """A row whose min (or max) is a zero present with both signs: torch's amin / amax return
    either sign depending on where the zeros sit (and on vectorization), so int8's ``lo`` and
    ``scale`` payloads can differ from torch's in the sign of that zero only; the codes are the
    same and the decoded values compare equal (== , +0 vs -0 at most)."""
    x = torch.rand(4, 300, generator=g)
    x[:, ::7] = 0.0
    x[:, 3::7] = -0.0
    x[2] = 0.0
    x[2, ::3] = -0.0                                     # max and min are both signed zeros
    x[3] = -x[3]                                         # max is the signed zero
    codec = CODECS["int8"]()
    want = codec.encode(x)
    got = tq.int8_encode(x)
    assert torch.equal(got[0], want[0]), "signed zeros: codes"
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), "signed zeros: values"
    for dtype in [torch.float32, torch.bfloat16]:
        assert torch.equal(tq.int8_decode(*got, dtype), codec.decode(want, dtype)), "decode"
    check_fp8(x, "signed zeros")                        # |x| has no sign: exact


def check_fp8_hardware_path(x: torch.Tensor, what: str) -> None:
    """``soft_cast=False`` (the GPU's code): the scales are torch's, the bytes are the
    interpreter's own cast of torch's scaled values ``x * inv``, and decoding equals torch's
    for outputs other than bfloat16 (which the interpreter truncates)."""
    for name, block in FP8:
        codec = CODECS[name]()
        want = codec.encode(x)
        q, scale = tq.fp8_encode(x, block, soft_cast=False)
        assert _same_floats(scale, want[1]), (name, what, "hw scales")
        rows, cols = x.shape
        inv = torch.where(want[1] > 0, 1.0 / want[1], torch.zeros_like(want[1]))
        blk = torch.arange(cols) // (cols if block is None else block)
        v = (x.float() * inv[:, blk]).reshape(-1)
        cast = _run(_cast_kernel, v, torch.uint8, soft=False).view(rows, cols)
        assert torch.equal(q, cast), (name, what, "hw bytes", _bad(q, cast))
        for dtype in [torch.float32, torch.float16, torch.float64]:
            _check_decode(codec, want, tq.fp8_decode(*want, block, dtype, soft_cast=False),
                          dtype, f"{name} {what} hw")
    codec = CODECS["int8"]()
    want = codec.encode(x)
    for dtype in [torch.float32, torch.float16, torch.float64]:
        _check_decode(codec, want, tq.int8_decode(*want, dtype, soft_cast=False), dtype,
                      f"int8 {what} hw")


def main() -> None:
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    check_casts(g)
    t1 = time.perf_counter()
    every = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    for cols in [1, 5, 127, 128, 129, 300]:
        x = _rows(g, 3, cols)
        check_fp8(x, f"gaussian {cols}", every if cols == 300 else None)
        check_int8(x, f"gaussian {cols}", every if cols == 300 else None)
    mixed = _mixed(g)
    check_fp8(mixed, "mixed")
    check_int8(mixed, "mixed")
    check_fp8(_fp8_tiny(g), "tiny blocks")
    check_fp8(_fp8_ties(g), "e4m3 ties")
    check_int8(_int8_ties(g), "rounding ties")
    long = _rows(g, 2, 5000)                             # 3 column tiles, 40 blocks per row
    check_fp8(long, "long rows")
    check_int8(long, "long rows")
    wide = _rows(g, 3, 400)
    check_fp8(wide[:, 7:307], "strided view")
    check_int8(wide[:, 7:307], "strided view")
    for dtype in [torch.float16, torch.bfloat16, torch.float64]:
        for cols in [1, 5, 129, 300]:
            x = _rows(g, 3, cols).to(dtype)
            check_fp8(x, f"{dtype} {cols}", [dtype, torch.float32])
            check_int8(x, f"{dtype} {cols}", [dtype, torch.float32])
        m = _mixed(g, big=1e4, small=1e-6) if dtype == torch.float16 else mixed
        check_fp8(m.to(dtype), f"{dtype} mixed")
        check_int8(m.to(dtype), f"{dtype} mixed")
    bf = _rows(g, 2, 130)
    bf[0, :8] = torch.tensor([1e-39, -3e-40, 1e-44, 0.0, -0.0, 5e-39, 1e-38, -1e-38])
    check_fp8(bf.to(torch.bfloat16), "bfloat16 subnormals")
    check_int8(bf.to(torch.bfloat16), "bfloat16 subnormals")
    check_signed_zeros(g)
    check_fp8(torch.zeros(0, 16), "empty 0x16")          # nothing to read
    check_int8(torch.zeros(0, 16), "empty 0x16")
    check_int8(torch.zeros(4, 0), "empty 4x0")
    # zero-width rows: torch's fp8 (block 128) encode fails on them (it pads the empty row to
    # a block and cannot view it back); the kernels give what it means: no bytes, scales 0
    q, scale = tq.fp8_encode(torch.zeros(4, 0), 128)
    assert q.shape == (4, 0) and torch.equal(scale, torch.zeros(4, 1)), "fp8 4x0"
    _check_encode(tq.fp8_encode(torch.zeros(4, 0), None), CODECS["fp8-row"]().encode(
        torch.zeros(4, 0)), "fp8-row 4x0")
    # every e4m3 byte and every uint8 code through decode
    codes = torch.arange(256, dtype=torch.uint8).view(2, 128)
    scale = torch.tensor([[0.5], [3e-3]])
    for dtype in every:
        _check_decode(CODECS["fp8-row"](), [codes, scale], tq.fp8_decode(codes, scale, None, dtype),
                      dtype, "all bytes")
        lo = torch.tensor([[-1.7], [12.25]])
        _check_decode(CODECS["int8"](), [codes, scale, lo],
                      tq.int8_decode(codes, scale, lo, dtype), dtype, "all codes")
    t2 = time.perf_counter()
    for cols in [5, 129, 300]:
        check_fp8_hardware_path(_rows(g, 3, cols), f"gaussian {cols}")
    check_fp8_hardware_path(mixed, "mixed")
    check_fp8_hardware_path(long, "long rows")
    t3 = time.perf_counter()
    print(f"casts {t1 - t0:.1f}s, payloads {t2 - t1:.1f}s, hardware-cast path {t3 - t2:.1f}s")
    print("triton quant kernels match")


# ------------------------------------------------------------------------------ compile check

def compile_sm90() -> None:
    """Compile every kernel as the launchers call them (hardware casts, enable_fp_fusion=False)
    for an H100 (sm_90) without a GPU (run without TRITON_INTERPRET): the interpreter neither
    type-checks nor lowers to PTX; this does. The PTX must divide with div.rn (Triton's fp32
    ``/`` is approximate), have no fma (a product and a sum rounded once), and round with
    cvt.rn.satfinite.e4m3x2 / cvt.rn.bf16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def build(fn, ptrs: dict, const: dict, warps: int = 4) -> str:
        sig = {}
        for a in fn.arg_names:
            sig[a] = "constexpr" if a in const else ptrs.get(a, "i32")
        k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "enable_fp_fusion": False})
        assert k.asm.get("cubin"), fn.__name__
        ptx = k.asm["ptx"]
        assert "fma." not in ptx, (fn.__name__, "fused multiply-add")
        assert "div.full" not in ptx and "div.approx" not in ptx, (fn.__name__, "division")
        return ptx

    f32 = "*fp32"
    n = 0
    for src in ["*fp32", "*bf16", "*fp16", "*fp64"]:
        ptx = build(tq._fp8_block_encode_kernel, {"x_ptr": src, "q_ptr": "*u8", "s_ptr": f32},
                    {"BLOCK": 128, "GROUP": 8, "SOFT": False})
        assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx, ("fp8", src)
        ptx = build(tq._fp8_row_encode_kernel, {"x_ptr": src, "q_ptr": "*u8", "s_ptr": f32},
                    {"TILE": 2048, "SOFT": False}, warps=8)
        assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx, ("fp8-row", src)
        ptx = build(tq._int8_encode_kernel, {"x_ptr": src, "q_ptr": "*u8", "s_ptr": f32,
                                             "lo_ptr": f32}, {"TILE": 1024})
        # round half even: + 2^23 then - 2^23, both kept
        assert "div.rn.f32" in ptx and "0f4B000000" in ptx and "0fCB000000" in ptx, ("int8", src)
        n += 3
    for out in ["*fp32", "*bf16", "*fp16", "*fp64"]:
        for block in [128, 0]:
            ptx = build(tq._fp8_decode_kernel, {"q_ptr": "*u8", "s_ptr": f32, "out_ptr": out},
                        {"BLOCK": block, "TILE": 1024, "SOFT": False})
            assert "e4m3x2" in ptx, ("fp8 decode", out)
            assert out != "*bf16" or "cvt.rn.bf16.f32" in ptx, ("fp8 decode", out)
        ptx = build(tq._int8_decode_kernel, {"q_ptr": "*u8", "s_ptr": f32, "lo_ptr": f32,
                                             "out_ptr": out}, {"TILE": 2048, "SOFT": False},
                    warps=8)
        assert out != "*bf16" or "cvt.rn.bf16.f32" in ptx, ("int8 decode", out)
        n += 3
    # the integer-arithmetic casts compile too
    build(tq._fp8_block_encode_kernel, {"x_ptr": f32, "q_ptr": "*u8", "s_ptr": f32},
          {"BLOCK": 128, "GROUP": 8, "SOFT": True})
    build(tq._fp8_decode_kernel, {"q_ptr": "*u8", "s_ptr": f32, "out_ptr": "*bf16"},
          {"BLOCK": 128, "TILE": 1024, "SOFT": True})
    # and the launchers pass that option: every kernel[grid](...) call in the module
    import ast
    import inspect

    launches = [c for c in ast.walk(ast.parse(inspect.getsource(tq)))
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)
                and isinstance(c.func.value, ast.Name) and c.func.value.id.endswith("_kernel")]
    assert len(launches) == 5, len(launches)
    for c in launches:
        kw = {k.arg: k.value for k in c.keywords}
        ok = isinstance(kw.get("enable_fp_fusion"), ast.Constant) and \
            kw["enable_fp_fusion"].value is False
        assert ok, (c.func.value.id, "launched without enable_fp_fusion=False")
    print(f"{n + 2} kernel variants")
    print("triton quant kernels compile")


LAUNCHERS = [(tq, n) for n in ("fp8_encode", "fp8_decode", "int8_encode", "int8_decode")]

if __name__ == "__main__":
    from tests.helpers.triton_checks import cli

    cli(main, compile_sm90, LAUNCHERS)
