"""Run by tests/test_zfp_triton.py in a subprocess with TRITON_INTERPRET=1 (Triton's own CPU
interpreter, which must be set before the kernels are defined): the Triton kernels against the
torch back end, bit for bit."""

from __future__ import annotations

import torch

from moeflow.comm.codecs import zfp
from moeflow.comm.codecs.zfp import triton_backend as tb


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for rows, cols in [(3, 37), (2, 64), (5, 5), (1, 1)]:
        for rate in [3, 8, 8.25, 12.5, 16]:
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
    print("triton kernels match")


if __name__ == "__main__":
    main()
