"""The compiled CPU coder (zfp.numba_backend) against the slow reference coder
(tests/reference/zfp_bitplane.py), which test_zfp.py holds to zfpy, and the dispatch of zfp.compress/decompress."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
import torch

from moeflow.comm.codecs import zfp
from moeflow.comm.codecs.zfp import numba_backend
from tests.reference import zfp_bitplane as bitplane
from moeflow.comm.codecs.zfp import transform as T
from tests.unit.zfp.test_zfp import _kinds

RATES = {1: [2.5, 8, 16, 31], 2: [1, 3.5, 8, 16, 40], 3: [0.5, 2, 8, 20, 32]}
SHAPES = {1: [(37,), (3, 10)], 2: [(9, 11), (1, 1), (2, 3, 8)], 3: [(5, 6, 7), (3, 9, 2)]}


def random_streams(shape, d, seed):
    """(rate, maxbits, stream) for random bit strings sized for ``shape``: dense ones and
    sparser ones (bytes and-ed together), rates 1-32."""
    g = torch.Generator().manual_seed(seed)
    for rate in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        mb = T.maxbits_for(rate, d)
        nb = T.stream_bytes(T.blocks_per_array(shape, d), mb)
        for t in range(6):
            data = torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g)
            for _ in range(t % 3):                          # sparser bit patterns too
                data &= torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g)
            yield rate, mb, data


@pytest.mark.parametrize("d", [1, 2, 3])
def test_numba_coder_equals_reference_coder(d):
    for shape in SHAPES[d]:
        for kind, a in _kinds(shape).items():
            x = torch.from_numpy(np.asarray(a, np.float32))
            for rate in RATES[d]:
                mb = T.maxbits_for(rate, d)
                ref = bitplane.compress(x, d, mb)
                got = numba_backend.compress(x, d, mb)
                assert got.shape == ref.shape and torch.equal(got, ref), (shape, kind, rate)
                want = bitplane.decompress(ref, shape, d, mb)
                out = numba_backend.decompress(got, shape, d, mb)
                assert torch.equal(out.view(torch.int32), want.view(torch.int32)), \
                    (shape, kind, rate)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_decoder_follows_zfp_on_arbitrary_streams(d):
    """Random bit strings (cut-short unary runs, the implied last coefficient, planes past the
    budget, int32 wrap-around in the inverse transform) decode as the reference coder does."""
    shape = {1: (400,), 2: (8, 12), 3: (4, 8, 8)}[d]
    for rate, mb, data in random_streams(shape, d, seed=10 + d):
        ref = bitplane.decompress(data, shape, d, mb)
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


def test_cpu_and_other_devices_use_the_compiled_coder(monkeypatch):
    """CPU tensors go to the numba coder, and so do tensors of devices that are neither CPU nor
    CUDA with triton (copied to the CPU and back)."""
    assert zfp.backend("cpu", 1) == zfp.backend("cpu", 3) == zfp.backend("meta", 2) == "numba"
    calls = []
    real = numba_backend._run
    monkeypatch.setattr(numba_backend, "_run", lambda *a: calls.append(a[:2]) or real(*a))
    x = torch.randn(9, 13)
    y = zfp.decompress(zfp.compress(x, 8, dims=2), x.shape, 8, dims=2)
    assert calls == [(2, 0), (2, 1)] and (y - x).abs().max() < 0.1


def test_closures_hold_plain_values_and_the_cache_key_follows_every_source(tmp_path):
    """numba keys its disk cache by the closure's contents, which must pickle the same in every
    process (plain values); and the cache directory must change with any source of the package,
    since code is inlined across its files (numba checks only the defining file), but not with
    where the package lives (a read-only copy shares the cache)."""
    for d in (1, 2, 3):
        for which in (0, 1):
            fn = numba_backend._build(d, which).py_func
            cells = [c.cell_contents for c in fn.__closure__]
            assert all(type(c) is int for c in cells) and d in cells, cells
            assert fn.__qualname__ == ("encode", "decode")[which] + f"_{d}d"
    here = pathlib.Path(numba_backend.__file__).parent
    copy = tmp_path / "zfp"
    shutil.copytree(here, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert numba_backend.env_key(copy) == numba_backend.env_key(here)
    with open(copy / "numba_simd.py", "a") as f:
        f.write("# an edit\n")
    numba_backend.env_key.cache_clear()
    assert numba_backend.env_key(copy) != numba_backend.env_key(here)
    assert numba_backend.cache_dir().name == numba_backend.env_key(here)
