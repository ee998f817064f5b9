"""The 1-D path at every block size: the compiled coder (``numba_backend``, table-driven for
1-D blocks) against the reference bit-plane coder (``bitplane``) and LLNL's zfpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow.comm.codecs import zfp
from moeflow.comm.codecs.zfp import numba_backend
from tests.reference import zfp_bitplane as bitplane

# every size up to 72 bits (rate 18), then sizes around word and budget boundaries
MAXBITS = list(range(9, 73)) + [79, 96, 100, 119, 127, 128, 129, 143, 192, 255, 256, 300]


def _kinds(nblocks: int = 400) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(3)
    shape = (nblocks, 4)
    nonfinite = rng.standard_normal(shape)
    nonfinite[::7, 1] = np.nan
    nonfinite[::11] = np.nan
    nonfinite[::13, 2] = np.inf
    nonfinite[::17, 0] = -np.inf
    kinds = {
        "gaussian": rng.standard_normal(shape),
        "smooth": np.sin(np.arange(4 * nblocks).reshape(shape) / 9.0),
        "zeros": np.zeros(shape),
        "neg_zero": -np.zeros(shape),
        "denormal": rng.standard_normal(shape) * 1e-40,
        "smallest_denormals": rng.integers(-3, 4, shape) * 1.4e-45,
        "huge_range": rng.standard_normal(shape) * 10.0 ** rng.integers(-38, 38, shape),
        "near_max": rng.uniform(-3.4e38, 3.4e38, shape),
        "mixed_zero_blocks": np.where(rng.random(shape) < 0.3, 0.0, rng.standard_normal(shape)),
        "one_hot": np.eye(4)[rng.integers(0, 4, nblocks)] * rng.standard_normal((nblocks, 1)),
        "nonfinite": nonfinite,
    }
    return {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in kinds.items()}


def test_encoder_and_decoder_equal_the_reference_coder_at_every_size():
    """Every kind in rows of 100 blocks (codes straddle word boundaries at every size), all
    rows in one call of each coder."""
    kinds = _kinds()
    rows = torch.cat([blocks.reshape(4, 400) for blocks in kinds.values()])
    for mb in MAXBITS:
        got = numba_backend.compress(rows, 1, mb)
        dec = numba_backend.decompress(got, rows.shape, 1, mb).view(torch.int32)
        want = bitplane.compress(rows, 1, mb)
        ref = bitplane.decompress(got, rows.shape, 1, mb).view(torch.int32)
        for i, kind in enumerate(kinds):
            r = slice(4 * i, 4 * i + 4)
            assert torch.equal(got[r], want[r]), f"{kind}, maxbits {mb}, encode"
            assert torch.equal(dec[r], ref[r]), f"{kind}, maxbits {mb}, decode"


def test_decoder_of_arbitrary_codes_equals_the_reference_decoder():
    """Any bit pattern, not only what the encoder writes (zfp decodes whatever it reads),
    including a nonzero block with an all-zero body, which runs past plane 0 (zfp stops there
    with budget left) at more than 32 bits of budget."""
    g = torch.Generator().manual_seed(5)
    for mb in MAXBITS:
        bits = torch.randint(0, 2, (1000, mb), generator=g, dtype=torch.uint8)
        bits[:, 0] = 1
        bits[::10] = 0
        bits[::10, :9] = torch.tensor([1, 0, 0, 1, 1, 0, 0, 0, 1], dtype=torch.uint8)  # emax 13
        data = bitplane.pack_bits(bits.reshape(1, -1))
        got = numba_backend.decompress(data, (1, 4000), 1, mb).view(torch.int32)
        ref = bitplane.decompress(data, (1, 4000), 1, mb).view(torch.int32)
        assert torch.equal(got, ref), f"maxbits {mb}"


def test_every_rate_matches_zfpy_on_rows():
    """Each row its own stream: rows whose blocks do not fill whole groups of stream words."""
    zfpy = pytest.importorskip("zfpy")
    rng = np.random.default_rng(9)
    rows = np.stack([rng.standard_normal(1667), np.sin(np.arange(1667) / 17.0),
                     rng.standard_normal(1667) * 1e-39]).astype(np.float32)
    for mb in MAXBITS:
        rate = mb / 4
        ours = zfp.compress(torch.from_numpy(rows), rate, dims=1)
        dec = zfp.decompress(ours, rows.shape, rate, dims=1).numpy()
        for r, a in enumerate(rows):
            z = zfpy.compress_numpy(a, rate=rate, write_header=False)
            assert bytes(ours[r].numpy().tobytes()) == z, f"maxbits {mb}, row {r}"
            ref = zfpy._decompress(z, zfpy.type_float, [a.size], rate=rate)
            np.testing.assert_array_equal(dec[r].view(np.int32), ref.view(np.int32),
                                          f"maxbits {mb}, row {r}")


def test_unaligned_payload_bytes_decode():
    x = torch.randn(5, 37)
    data = zfp.compress(x, 6, dims=1)
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), data.reshape(-1)])[3:]
    got = zfp.decompress(shifted.reshape(data.shape), x.shape, 6, dims=1)
    assert torch.equal(got, zfp.decompress(data, x.shape, 6, dims=1))


def test_rows_shorter_than_a_group_of_words():
    """A 1-block row at 24 bits is one stream word out of a 3-word group."""
    zfpy = pytest.importorskip("zfpy")
    x = np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)
    ours = zfp.compress(torch.from_numpy(x), 6, dims=1)
    assert ours.shape == (4, 8)
    for r in range(4):
        assert bytes(ours[r].numpy().tobytes()) == zfpy.compress_numpy(x[r], rate=6,
                                                                        write_header=False)
