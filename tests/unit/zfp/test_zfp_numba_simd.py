"""The vector code of the compiled ZFP coder (zfp.numba_simd) against the scalar definitions:
bit-plane gather/scatter against the loops of zfp's encode_ints/decode_ints, and the block
pipeline against zfp.transform (cast, lifting, sequency order, negabinary)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from numba import njit  # noqa: E402
from numba.core.errors import TypingError  # noqa: E402

from moeflow.comm.codecs.zfp import transform as T  # noqa: E402
from moeflow.comm.codecs.zfp.numba_simd import (  # noqa: E402
    deposit_plane, fwd_block, inv_block, plane_bits)


@njit
def _planes(u, S):
    out = np.empty(32, dtype=np.uint64)
    for k in range(32):
        out[k] = plane_bits(u, k, S)
    return out


@njit
def _deposit_all(planes, S):
    u = np.zeros(S, dtype=np.uint32)
    for k in range(32):
        deposit_plane(u, planes[k], k, S)
    return u


@njit
def _fwd(fb, scale, u, d):
    fwd_block(fb, scale, u, d)


@njit
def _inv(u, scale, fb, d):
    inv_block(u, scale, fb, d)


@njit
def _literal_sizes(u):
    """The same intrinsics with literal sizes (no switch)."""
    fb = np.empty(16, dtype=np.float32)
    inv_block(u, np.float32(1.0), fb, 2)
    return plane_bits(u, 3, 16), fb


@pytest.mark.parametrize("S", [4, 16, 64])
def test_plane_gather_and_scatter_match_the_scalar_loops(S):
    rng = np.random.default_rng(S)
    for u in (rng.integers(0, 2 ** 32, S, dtype=np.uint64).astype(np.uint32),
              np.zeros(S, np.uint32), np.full(S, 0xFFFFFFFF, np.uint32),
              (rng.integers(0, 2 ** 32, S, dtype=np.uint64)
               & rng.integers(0, 2 ** 32, S, dtype=np.uint64)).astype(np.uint32)):
        got = _planes(u, S)
        want = [sum(((int(u[i]) >> k) & 1) << i for i in range(S)) for k in range(32)]
        assert [int(v) for v in got] == want
        assert np.array_equal(_deposit_all(got, S), u)


def _blocks(d, n=300):
    """float32 blocks: Gaussian, mixed scales, and zfp's hard cases in single entries."""
    g = torch.Generator().manual_seed(d)
    S = 4 ** d
    b = torch.randn(n, S, generator=g) * torch.exp2(torch.randint(-60, 60, (n, 1), generator=g)
                                                    .float())
    special = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3e38, 3.4e38, 1e-39]
    for r, v in enumerate(special):
        b[r, r % S] = v
    b[len(special)] = 0.0
    return b


@pytest.mark.parametrize("d", [1, 2, 3])
def test_forward_block_pipeline_matches_transform(d):
    b = _blocks(d)
    emax = T.block_emax(b)
    want = T.fwd_order(T.fwd_xform(T.fwd_cast(b, emax), d), d)
    scale = T._pow2_f32(30 - emax)
    u = np.empty(4 ** d, np.uint32)
    for r in range(b.shape[0]):
        _fwd(b[r].numpy().copy(), np.float32(scale[r]), u, d)
        assert np.array_equal(u.astype(np.int64), want[r].numpy()), r


@pytest.mark.parametrize("d", [1, 2, 3])
def test_inverse_block_pipeline_matches_transform(d):
    """Random negabinary words (int32 wrap-around in the inverse lifting) and exponents,
    including ones whose scale under- or overflows float32."""
    g = torch.Generator().manual_seed(10 + d)
    S = 4 ** d
    u = torch.randint(0, 2 ** 32, (200, S), generator=g, dtype=torch.int64)
    u[:50] &= torch.randint(0, 2 ** 32, (50, S), generator=g, dtype=torch.int64)
    emax = torch.randint(-160, 130, (200,), generator=g)
    want = T.inv_cast(T.inv_xform(T.inv_order(u, d), d), emax)
    scale = T._pow2_f32(emax - 30)
    fb = np.empty(S, np.float32)
    for r in range(u.shape[0]):
        _inv(u[r].numpy().astype(np.uint32), np.float32(scale[r]), fb, d)
        assert np.array_equal(fb.view(np.int32), want[r].numpy().view(np.int32)), r


def test_literal_and_runtime_sizes_give_the_same_code():
    u = np.random.default_rng(0).integers(0, 2 ** 32, 16, dtype=np.uint64).astype(np.uint32)
    x, fb = _literal_sizes(u)
    out = np.empty(16, np.float32)
    _inv(u, np.float32(1.0), out, 2)
    assert x == _planes(u, 16)[3] and np.array_equal(fb.view(np.int32), out.view(np.int32))


def test_wrong_arguments_fail_at_compile_time():
    @njit
    def bad_dtype(u):
        return plane_bits(u, 0, 4)

    with pytest.raises(TypingError, match="uint32"):
        bad_dtype(np.zeros(4, np.int64))
    with pytest.raises(TypingError, match="count must be an integer"):
        _planes(np.zeros(16, np.uint32), 16.0)


def test_unsupported_sizes_raise_instead_of_touching_memory():
    u = np.zeros(64, np.uint32)
    with pytest.raises(ValueError, match=r"plane gather count must be one of \(4, 16, 64\)"):
        _planes(u, 8)
    with pytest.raises(ValueError, match="plane scatter count must be one of"):
        _deposit_all(np.zeros(32, np.uint64), 32)
    with pytest.raises(ValueError, match=r"block dimensionality d must be one of \(1, 2, 3\)"):
        _fwd(np.zeros(64, np.float32), np.float32(1.0), u, 4)
    with pytest.raises(ValueError, match="block dimensionality d must be one of"):
        _inv(u, np.float32(1.0), np.zeros(64, np.float32), 0)
