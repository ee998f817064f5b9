"""Run by tests/unit/zfp/test_zfp_triton_nd.py in a subprocess with TRITON_INTERPRET=1 (Triton's own CPU
interpreter, which must be set before the kernels are defined): the 2-D / 3-D Triton kernels of
``moeflow.comm.codecs.zfp.triton_nd`` against the reference coder (``bitplane``), bit for bit.

The kernels are called directly on CPU tensors (``zfp.compress`` sends only CUDA tensors to
them). Kept small: every kernel call runs in the interpreter, one numpy op per Triton op.
With ``--compile`` (and without TRITON_INTERPRET) it instead compiles both kernels for sm_90,
which needs no GPU."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from tests.reference import zfp_bitplane as tb
from moeflow.comm.codecs.zfp import triton_nd as tn
from moeflow.comm.codecs.zfp.transform import maxbits_for


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _check(x: torch.Tensor, d: int, rate: float, what: str) -> None:
    mb = maxbits_for(rate, d)
    ref = tb.compress(x, d, mb)
    got = tn.compress(x, d, mb)
    assert got.shape == ref.shape and got.dtype == torch.uint8, (what, d, rate, got.shape)
    if not torch.equal(got, ref):
        bad = (got != ref).nonzero()[:4].tolist()
        raise AssertionError(f"{what} d={d} rate={rate} {tuple(x.shape)}: bytes differ at {bad}")
    dec = tn.decompress(ref, tuple(x.shape), d, mb)
    want = tb.decompress(ref, tuple(x.shape), d, mb)
    assert _same_floats(dec, want), (what, d, rate, tuple(x.shape), "decode")


def _check_decode(shape: tuple[int, ...], d: int, rate: float, g) -> None:
    """Decode synthetic streams, blocks cycling through: random bits; a nonzero header, then
    j zero bits (j empty planes), a one (a group test) and zeros to the end, which at low rates
    cuts the run of zeros at the budget with few coefficients significant; an all-zero block
    (so the bits after such a cut are zeros, not the next block's nonzero bit); random bits
    with a nonzero header and the last 6 bits cleared. zfp's decoder rules at the budget, the
    implied last one-bit, any header and exponent."""
    mb = maxbits_for(rate, d)
    per = math.prod(-(-n // 4) for n in shape[len(shape) - d:])
    lead = shape[: len(shape) - d]
    nslices = math.prod(lead)
    bits = torch.randint(0, 2, (nslices, per, mb), generator=g, dtype=torch.uint8)
    kind = torch.arange(per) % 4
    j = torch.randint(0, min(32, mb - 9), (nslices, per), generator=g)
    t = torch.arange(mb - 9)
    run = torch.where(t == j[..., None], 1, 0).to(torch.uint8)      # 0^j 1 0...
    bits[:, kind == 1, 9:] = run[:, kind == 1]
    bits[:, kind == 2] = 0
    bits[:, kind == 3, mb - 6:] = 0
    bits[:, (kind == 1) | (kind == 3), 0] = 1
    data = tb.pack_bits(bits.reshape(nslices, per * mb)).reshape(*lead, -1)
    dec = tn.decompress(data, shape, d, mb)
    want = tb.decompress(data, shape, d, mb)
    assert _same_floats(dec, want), ("synthetic stream", d, rate, shape)


def _smooth(shape) -> torch.Tensor:
    grid = torch.from_numpy(np.indices(shape).sum(0).astype(np.float32))
    return torch.sin(grid / 3.0) + 0.1 * torch.cos(grid)


def _mixed_2d(g) -> torch.Tensor:
    """(2, 9, 10): slice 0 has, block by block (3 x 3 blocks, the last row and column partial),
    1e30 with 1e-30, zeros (after a nonzero block), denormals, a constant (few bit planes: the
    budget outlasts the 32 planes at high rates), Gaussian of wide scale with a NaN (skipped,
    as zfp), inf (exponent 0), Gaussian, zeros, -inf; slice 1 is smooth."""
    x = torch.randn(2, 9, 10, generator=g)
    x[0, 0:4, 0:4] *= 1e-30
    x[0, 1, 2] = 1e30                                     # huge range in one block
    x[0, 2, 3] = -3e29
    x[0, 0:4, 4:8] = 0.0                                  # all-zero block after a nonzero one
    x[0, 0:4, 8:10] *= 1e-40                              # denormals (a 4 x 2 block)
    x[0, 4:8, 0:4] = -3.25                                # constant
    x[0, 4:8, 4:8] *= torch.exp(4 * torch.randn(4, 4, generator=g))
    x[0, 4, 5] = float("nan")
    x[0, 5, 9] = float("inf")
    x[0, 8:9, 4:8] = 0.0                                  # a zero 1 x 4 block
    x[0, 8, 8] = float("-inf")                            # in the 1 x 2 block
    x[1] = _smooth((9, 10)) * 1e3
    return x


def _mixed_3d(g) -> torch.Tensor:
    """(2, 3, 5, 6): blocks of 3x4x4, 3x4x2, 3x1x4, 3x1x2 values (every padding width);
    slice 0: Gaussian, zeros, huge range with denormals, Gaussian with a NaN; slice 1: smooth."""
    x = torch.randn(2, 3, 5, 6, generator=g)
    x[0, :, 0:4, 4:6] = 0.0                               # all-zero block after a nonzero one
    x[0, :, 4:5, 0:4] *= 1e-40                            # denormals ...
    x[0, 1, 4, 2] = 1e30                                  # ... and 1e30 in one block
    x[0, 2, 4, 5] = float("nan")
    x[1] = _smooth((3, 5, 6)) - 0.5
    return x


def compile_sm90() -> None:
    """Compile both kernels for an H100 (sm_90) without a GPU (run without TRITON_INTERPRET):
    the interpreter does not type-check loop-carried values or lower to PTX; this does."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = ["nblocks", "per", "nbx", "nby", "nx", "ny", "nz", "slice_words"]
    for d, mb in [(1, 80), (2, 128), (3, 512)]:
        const = {"D": d, "S": 4 ** d, "MAXBITS": mb, "B": tn.BLOCKS[d]}
        for fn, ptrs, extra in [(tn._encode_kernel, ["*fp32", "*i32", "*i32"], []),
                                (tn._decode_kernel, ["*i32", "*fp32", "*i32"], ["nwords"])]:
            names = list(fn.arg_names)
            sig = dict(zip(names[:3], ptrs))
            sig.update({a: "i32" for a in ints + extra})
            sig.update({c: "constexpr" for c in const})
            k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": tn.NUM_WARPS[d]})
            assert k.asm.get("cubin"), (fn.__name__, d)
    print("triton nd kernels compile")


def main() -> None:
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    # 2-D: rates 1 (a run of zeros cut by the budget, then a zero block), 4, 8, 16, 30 and
    # 40 (640 bits: more than any block's 32 planes need)
    x2 = _mixed_2d(g)
    for rate in [1, 4, 8, 16, 30, 40]:
        _check(x2, 2, rate, "mixed")
    for shape in [(5, 7), (9, 4)]:
        x = torch.randn(*shape, generator=g) * torch.exp(3 * torch.randn(shape[0], 1,
                                                                         generator=g))
        for rate in [3, 12.5]:
            _check(x, 2, rate, "gaussian")
    _check(torch.zeros(5, 7), 2, 8, "zeros")
    _check_decode((3, 13, 14), 2, 3, g)
    _check_decode((5, 7), 2, 16, g)
    # 1-D (blocks above 64 bits, which the 1-D kernels of triton_backend hand over)
    x1 = x2.reshape(4, 45)
    for rate in [16.25, 24, 32]:
        _check(x1, 1, rate, "mixed")
    _check_decode((3, 37), 1, 20, g)
    t2 = time.perf_counter()
    # 3-D: rates 2, 4, 8, 16 on the mixed array, 32 (2048 bits) on a 4x4x4 + a partial block
    x3 = _mixed_3d(g)
    for rate in [2, 4, 8, 16]:
        _check(x3, 3, rate, "mixed")
    x = torch.randn(4, 4, 7, generator=g)
    x[:, :, 4:] = 1.5                                     # constant partial blocks
    _check(x, 3, 32, "gaussian")
    _check(torch.zeros(3, 5, 6), 3, 8, "zeros")
    _check_decode((2, 3, 9, 10), 3, 1.5, g)
    t3 = time.perf_counter()
    print(f"2-D {t2 - t0:.1f}s, 3-D {t3 - t2:.1f}s")
    print("triton nd kernels match")


LAUNCHERS = [(tn, "compress"), (tn, "decompress")]

if __name__ == "__main__":
    from tests.helpers.triton_checks import cli

    cli(main, compile_sm90, LAUNCHERS)
