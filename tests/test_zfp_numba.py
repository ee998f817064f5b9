"""The compiled CPU coder (zfp.numba_backend) against the torch coders and zfpy, and the
dispatch of zfp.compress/decompress between them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow.comm.codecs import zfp
from moeflow.comm.codecs.zfp import numba_backend, plane_decode, plane_encode, torch_backend
from moeflow.comm.codecs.zfp import transform as T
from tests.test_zfp import _kinds
from tests.test_zfp_planes import random_streams

pytest.importorskip("numba")

RATES = {1: [2.5, 8, 16, 31], 2: [1, 3.5, 8, 16, 40], 3: [0.5, 2, 8, 20, 32]}
SHAPES = {1: [(37,), (3, 10)], 2: [(9, 11), (1, 1), (2, 3, 8)], 3: [(5, 6, 7), (3, 9, 2)]}


def _torch_coder(d):
    if d == 1:
        return torch_backend.compress_1d, torch_backend.decompress_1d
    return ((lambda x, mb: plane_encode.compress(x, d, mb)),
            (lambda data, shape, mb: plane_decode.decompress(data, shape, d, mb)))


@pytest.mark.parametrize("d", [1, 2, 3])
def test_numba_coder_equals_torch_coders(d):
    enc, dec = _torch_coder(d)
    for shape in SHAPES[d]:
        for kind, a in _kinds(shape).items():
            x = torch.from_numpy(np.asarray(a, np.float32))
            for rate in RATES[d]:
                mb = T.maxbits_for(rate, d)
                ref = enc(x, mb)
                got = numba_backend.compress(x, d, mb)
                assert got.shape == ref.shape and torch.equal(got, ref), (shape, kind, rate)
                want = dec(ref, shape, mb)
                out = numba_backend.decompress(got, shape, d, mb)
                assert torch.equal(out.view(torch.int32), want.view(torch.int32)), \
                    (shape, kind, rate)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_decoder_follows_zfp_on_arbitrary_streams(d):
    """Random bit strings (cut-short unary runs, the implied last coefficient, planes past the
    budget, int32 wrap-around in the inverse transform) decode as the general coder does."""
    shape = {1: (400,), 2: (8, 12), 3: (4, 8, 8)}[d]
    for rate, mb, data in random_streams(shape, d, seed=10 + d):
        ref = torch_backend.decompress(data, shape, d, mb)
        got = numba_backend.decompress(data, shape, d, mb)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), rate


def test_unaligned_stream_views_decode():
    x = torch.randn(2, 12, 8)
    data = zfp.compress(x, 8, dims=2)                       # (2, nbytes)
    buf = torch.zeros(data.numel() + 1, dtype=torch.uint8)
    buf[1:] = data.reshape(-1)
    view = buf[1:].reshape(data.shape)                      # storage offset 1: not 8-aligned
    assert torch.equal(zfp.decompress(view, x.shape, 8, dims=2),
                       zfp.decompress(data, x.shape, 8, dims=2))


def test_inputs_that_require_grad_are_coded():
    x = torch.randn(6, 10, requires_grad=True)
    got = zfp.compress(x, 8, dims=2)
    assert torch.equal(got, zfp.compress(x.detach(), 8, dims=2))


def test_cpu_dispatch_uses_the_compiled_coder_and_falls_back_without_numba(monkeypatch):
    assert zfp.backend("cpu", 1) == zfp.backend("cpu", 2) == zfp.backend("cpu", 3) == "numba"
    assert zfp.backend("meta", 2) == "torch-planes"
    assert zfp.backend("meta", 1) == "torch-table"
    x = torch.randn(9, 13)
    ref = zfp.compress(x, 8, dims=2)
    calls = []
    real = plane_encode.compress
    monkeypatch.setattr(plane_encode, "compress", lambda *a, **k: calls.append(1) or real(*a, **k))
    zfp.compress(x, 8, dims=2)
    assert not calls                                        # numba coder, not the torch one
    monkeypatch.setattr(numba_backend, "numba", None)       # as on a machine without numba
    assert zfp.backend("cpu", 2) == "torch-planes"
    assert zfp.backend("cpu", 1) == "torch-table"
    v = torch.randn(3, 50)
    assert torch.equal(zfp.compress(v, 8, dims=1),
                       torch_backend.compress_1d(v, T.maxbits_for(8, 1)))
    assert torch.equal(zfp.compress(x, 8, dims=2), ref) and calls
    assert torch.equal(zfp.decompress(ref, x.shape, 8, dims=2).view(torch.int32),
                       plane_decode.decompress(ref, x.shape, 2, T.maxbits_for(8, 2))
                       .view(torch.int32))
    with pytest.raises(RuntimeError, match="needs numba"):
        numba_backend.compress(x, 2, 128)


def test_compiled_coders_are_cached_by_plain_values_and_the_inlined_sources():
    """numba keys its disk cache by the closure's contents: they must be plain values (a
    captured function pickles differently in each process, which would recompile the coder in
    every run), and they must change with the sources inlined from other files."""
    import hashlib
    import pathlib

    from moeflow.comm.codecs.zfp import numba_planes, numba_simd
    stamp = hashlib.sha256(b"".join(pathlib.Path(m.__file__).read_bytes()
                                    for m in (numba_planes, numba_simd))).hexdigest()
    for d in (1, 2, 3):
        for coder in numba_backend._coder(d):
            cells = [c.cell_contents for c in coder.py_func.__closure__]
            assert all(isinstance(c, (int, str)) for c in cells), cells
            assert stamp in cells and d in cells
