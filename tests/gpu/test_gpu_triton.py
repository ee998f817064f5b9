"""Every Triton codec kernel on a real GPU against its CPU result, bit for bit: the checks of
tests/helpers/*_check.py (which otherwise run under Triton's CPU interpreter) with ``--device cuda``,
and the codecs' own CUDA dispatch against their CPU encode/decode."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.triton_checks import run_check

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")


@pytest.mark.parametrize("module,expect", [
    ("triton_quant_check", "triton quant kernels match"),
    ("zfp_triton_check", "triton kernels match"),
    ("zfp_triton_nd_check", "triton nd kernels match"),
])
def test_triton_kernel_checks_on_cuda(module, expect):
    run_check(module, expect, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["int8", "fp8", "fp8-row", "zfp"])
def test_codec_cuda_dispatch_equals_cpu(name, dtype):
    """``codec.encode`` of a CUDA tensor (the Triton path) gives the CPU payload bytes, and
    ``decode`` the CPU values."""
    from moeflow.comm.codecs import CODECS

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 300, generator=gen) * torch.exp(2 * torch.randn(37, 1, generator=gen)))
    x = x.to(dtype)
    cpu, gpu = CODECS[name](), CODECS[name]()
    want = cpu.encode(x)
    got = gpu.encode(x.cuda())
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.is_cuda and a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype)
        assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)), name
    for out in (dtype, torch.float32):
        dec = gpu.decode(got, out)
        assert dec.is_cuda and dec.dtype == out
        ref = cpu.decode(want, out)
        assert torch.equal(dec.cpu().view(torch.uint8), ref.view(torch.uint8)), (name, out)
