"""Our ZFP (moeflow.comm.codecs.zfp) against LLNL's zfpy: same bytes, same decoded values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow.comm.codecs import CODECS, zfp
from moeflow.comm.codecs.zfp import transform

zfpy = pytest.importorskip("zfpy")

SHAPES = {1: (37,), 2: (9, 11), 3: (5, 6, 7)}
RATES = {1: [3, 8, 12.5, 16, 24], 2: [2, 8, 16], 3: [1, 8, 13]}   # zfpy 1.0.1 overruns its
# buffer for 1-D rates below 2.25 (it sizes the buffer from the rate, not the 9-bit minimum).


def _kinds(shape, seed=0):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    grid = np.indices(shape).sum(0).astype(np.float32)
    huge = rng.standard_normal(shape) * 10.0 ** rng.integers(-38, 38, shape)
    return {
        "gaussian": rng.standard_normal(shape),
        "smooth": np.sin(grid / 3.0) + 0.1 * np.cos(grid),
        "zeros": np.zeros(shape),
        "neg_zero": -np.zeros(shape),
        "constant": np.full(shape, -3.25),
        "denormal": rng.standard_normal(shape) * 1e-40,
        "tiny_normal": rng.standard_normal(shape) * 1e-36,
        "huge_range": huge,
        "near_max": rng.uniform(-3.4e38, 3.4e38, shape),
        "mixed_zero_blocks": np.where(rng.random(shape) < 0.5, 0.0, rng.standard_normal(shape)),
        "powers_of_two": 2.0 ** rng.integers(-20, 20, shape) * rng.choice([-1, 1], shape),
        "ramp": np.arange(n, dtype=np.float64).reshape(shape) * 1e5,
    }


def _zfpy(a, rate):
    z = zfpy.compress_numpy(np.ascontiguousarray(a, np.float32), rate=rate, write_header=False)
    return z, zfpy._decompress(z, zfpy.type_float, list(a.shape), rate=rate)


def _check(a, rate, d):
    a = np.asarray(a, dtype=np.float32)
    ours = zfp.compress(torch.from_numpy(a), rate, dims=d)
    z, ref = _zfpy(a, rate)
    assert ours.numel() == len(z) == zfp.compressed_bytes(a.shape, rate, d)
    assert bytes(ours.numpy().tobytes()) == z
    dec = zfp.decompress(ours, a.shape, rate, dims=d).numpy()
    np.testing.assert_array_equal(dec.view(np.int32), ref.view(np.int32))   # bit for bit


@pytest.mark.parametrize("d", [1, 2, 3])
def test_same_bytes_and_values_as_zfpy(d):
    for kind, a in _kinds(SHAPES[d]).items():
        for rate in RATES[d]:
            try:
                _check(a, rate, d)
            except AssertionError as err:
                raise AssertionError(f"{kind}, rate {rate}, dims {d}: {err}") from None


@pytest.mark.parametrize("shape", [(1,), (2,), (3,), (4,), (5,), (1, 1), (2, 7), (6, 1),
                                   (1, 2, 3), (4, 4, 4), (3, 9, 2)])
def test_partial_blocks_padded_like_zfp(shape):
    a = np.random.default_rng(1).standard_normal(shape)
    _check(a, 8, len(shape))


def test_non_finite_values_follow_zfpy():
    """ZFP cannot represent inf/NaN. A block holding them decodes to finite garbage in LLNL zfp
    (its float->int cast of inf/NaN gives INT_MIN on x86-64); we reproduce that bit for bit,
    and the codecs carry such payloads through by default (the layer counts them) and reject
    them when built with check_finite=True."""
    a = np.array([np.inf, 1, 2, 3, np.nan, 1, 2, 3, -np.inf, 0, 0, 0, np.nan, np.nan, np.nan,
                  np.nan, 1, 2, 3, 4], dtype=np.float32)
    for rate in (8, 16, 32):
        _check(a, rate, 1)
    _check(a[:16].reshape(4, 4), 16, 2)
    codec = CODECS["zfp"](check_finite=True)
    with pytest.raises(ValueError, match="inf or NaN"):
        codec.encode(torch.from_numpy(a).reshape(4, 5))
    loose = CODECS["zfp"]()
    out = loose.decode(loose.encode(torch.from_numpy(a).reshape(4, 5)), torch.float32)
    assert torch.isfinite(out).all() and torch.equal(out[3], torch.tensor([1., 2, 3, 4, 0]) * 0
                                                     + out[3])


def test_leading_dims_are_independent_arrays():
    a = np.random.default_rng(2).standard_normal((3, 5, 9)).astype(np.float32)
    ours = zfp.compress(torch.from_numpy(a), 8, dims=2)
    dec = zfp.decompress(ours, a.shape, 8, dims=2).numpy()
    for i in range(3):
        z, ref = _zfpy(a[i], 8)
        assert bytes(ours[i].numpy().tobytes()) == z
        np.testing.assert_array_equal(dec[i], ref)


def test_half_precision_inputs_are_converted():
    x = torch.randn(3, 40)
    for dt in (torch.float16, torch.bfloat16):
        xd = x.to(dt)
        got = zfp.decompress(zfp.compress(xd, 8, dims=1), xd.shape, 8, dims=1, dtype=dt)
        ref = zfp.decompress(zfp.compress(xd.float(), 8, dims=1), xd.shape, 8, dims=1)
        assert got.dtype == dt and torch.equal(got, ref.to(dt))


def test_codec_payload_equals_zfpy_codec_payload():
    x = torch.randn(7, 66)
    ours, ref = CODECS["zfp"](), CODECS["zfpy"]()
    p, q = ours.encode(x)[0], ref.encode(x)[0]
    assert torch.equal(p, q)
    assert torch.equal(ours.decode([p], torch.float32), ref.decode([q], torch.float32))
    x = torch.randn(6, 64)                    # the one-call zfpy path (rows fill whole words)
    assert torch.equal(ours.encode(x)[0], ref.encode(x)[0])


@pytest.mark.parametrize("rate", [3, 4, 6, 8, 16])
def test_codec_error_bound(rate):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g) * torch.exp(4 * torch.randn(64, 1, generator=g))
    x[:, :4] = 5.0                                          # constant blocks
    x[1] = torch.linspace(-1, 1, 128)                        # smooth
    codec = CODECS["zfp"](rate=rate)
    y = codec.decode(codec.encode(x), torch.float32)
    blocks = x.reshape(-1, 4)
    emax = transform.block_emax(blocks).double()
    bound = torch.pow(2.0, emax) * min(4.0, 2.0 ** (4 - (4 * rate - 9) / 4))
    assert ((y.reshape(-1, 4) - blocks).abs().double() <= bound.unsqueeze(1)).all()


def test_zfpy_codec_rejects_cuda_and_bad_inputs_fail_clearly():
    from moeflow.config import ConfigError
    codec = CODECS["zfpy"]()
    assert not codec.supports(torch.float32, "cuda")
    with pytest.raises(ConfigError, match="CPU only"):
        codec._need_cpu(torch.empty(0, device="meta"))
    with pytest.raises(ValueError, match="dims"):
        zfp.compress(torch.randn(4, 4), 8, dims=4)
    with pytest.raises(ValueError, match="dtype"):
        zfp.compress(torch.ones(8, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="rate"):
        zfp.compress(torch.randn(8), 0)
    with pytest.raises(ValueError, match="bytes"):
        zfp.decompress(torch.zeros(3, dtype=torch.uint8), (8,), 8)
    streams = zfp.compress(torch.randn(3, 16), 8, dims=1)
    with pytest.raises(ValueError, match=r"4 stream\(s\) of 16 bytes, but data \(3, 16\) holds 3"):
        zfp.decompress(streams, (4, 16), 8, dims=1)
    with pytest.raises(ValueError, match="rate"):
        CODECS["zfp"](rate=-1)
