"""Run by tests/unit/zfp/test_zfp_triton.py in a subprocess with TRITON_INTERPRET=1 (Triton's own CPU
interpreter, which must be set before the kernels are defined): the 1-D Triton kernels against the
CPU coder, bit for bit (rates above 16 go to triton_nd's general kernels with d = 1). With ``--compile`` (and without TRITON_INTERPRET) it instead
compiles both kernels for sm_90, which needs no GPU."""

from __future__ import annotations

import torch

from moeflow.comm.codecs import zfp
from moeflow.comm.codecs.zfp import triton_backend as tb
from moeflow.comm.codecs.zfp import triton_nd as tn


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for rows, cols in [(3, 37), (2, 64), (5, 5), (1, 1)]:
        for rate in [3, 8, 8.25, 12.5, 16, 20.25, 31]:
            x = torch.randn(rows, cols, generator=g) * torch.exp(3 * torch.randn(rows, 1,
                                                                                  generator=g))
            x[0, :4] = 0.0
            if cols > 8:
                x[-1, 4:8] = 1e-40                       # a denormal block
            ref = zfp.compress(x, rate, dims=1)
            got = tb.compress_rows(x, rate)
            assert torch.equal(got, ref), (rows, cols, rate, "encode")
            y = tb.decompress_rows(ref, cols, rate)
            r = zfp.decompress(ref, (rows, cols), rate, dims=1)
            assert torch.equal(y.view(torch.int32), r.view(torch.int32)), (rows, cols, rate)
    _check_dispatch(g)
    print("triton kernels match")


def _check_dispatch(g) -> None:
    """``zfp.compress`` / ``decompress`` send CUDA tensors to the kernels; here (CPU tensors
    under the interpreter) the CUDA test is forced true, so their reshaping of leading axes
    and 1-D rows is checked against the CPU path."""
    cases = [((2, 3, 37), 1, 8), ((5,), 1, 3), ((2, 9, 10), 2, 8), ((6, 5, 7), 3, 4)]
    want = {}
    for shape, d, rate in cases:
        x = torch.randn(*shape, generator=g)
        c = zfp.compress(x, rate, dims=d)
        want[shape] = (x, c, zfp.decompress(c, shape, rate, dims=d))
    real = zfp._triton_for
    zfp._triton_for = lambda t: True
    try:
        for shape, d, rate in cases:
            x, c, y = want[shape]
            assert torch.equal(zfp.compress(x, rate, dims=d), c), (shape, "dispatch encode")
            got = zfp.decompress(c, shape, rate, dims=d)
            assert torch.equal(got.view(torch.int32), y.view(torch.int32)), (shape, "dispatch")
    finally:
        zfp._triton_for = real


def compile_sm90() -> None:
    """Compile both 1-D kernels for an H100 (sm_90) without a GPU (run without TRITON_INTERPRET):
    the interpreter does not type-check loop-carried values or lower to PTX; this does. The
    encoder at MAXBITS 32 and 64; the decoder also at 12, its third branch of the bit masks
    (< 32, < 64, 64)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = ["rows", "cols", "nblk", "row_words"]
    enc = (tb._encode_kernel, ["*fp32", "*i32", "*i64"])
    dec = (tb._decode_kernel, ["*i32", "*fp32", "*i64"])
    for (fn, ptrs), mb in [(enc, 32), (enc, 64), (dec, 12), (dec, 32), (dec, 64)]:
        const = {"MAXBITS": mb, "BLOCKS": tb.BLOCKS}
        names = list(fn.arg_names)
        sig = dict(zip(names[:3], ptrs))
        sig.update({a: "i32" for a in ints})
        sig.update({c: "constexpr" for c in const})
        assert set(sig) == set(names), (fn.__name__, names)
        k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4})
        assert k.asm.get("cubin"), (fn.__name__, mb)
    print("triton kernels compile")


LAUNCHERS = [(tb, "compress_rows"), (tb, "decompress_rows"), (tn, "compress"),
             (tn, "decompress")]

if __name__ == "__main__":
    from tests.helpers.triton_checks import cli

    cli(main, compile_sm90, LAUNCHERS)
