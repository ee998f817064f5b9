"""The 1-D table coder of the CPU path (``group_encode``, ``window_decode``) against the
general bit-plane coder (``bitplane``, any d) and LLNL's zfpy, at every block size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow.comm.codecs import zfp
from moeflow.comm.codecs.zfp import group_encode, torch_backend, window_decode

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


def _general_codes(blocks: torch.Tensor, maxbits: int) -> torch.Tensor:
    """The same codes from the general (any d) bit-plane coder, as int64 words per block."""
    bits = torch_backend.encode_blocks(blocks, 1, maxbits).to(torch.int64)
    bits = torch.nn.functional.pad(bits, (0, (-maxbits) % 64)).reshape(len(blocks), -1, 64)
    return (bits << torch.arange(64)).sum(2)


def _general_decode(codes: torch.Tensor, maxbits: int) -> torch.Tensor:
    bits = ((codes.unsqueeze(2) >> torch.arange(64)) & 1).reshape(len(codes), -1)[:, :maxbits]
    return torch_backend.decode_blocks(bits.to(torch.uint8), 1)


def test_encoder_equals_general_bitplane_coder_at_every_size():
    for kind, blocks in _kinds().items():
        for mb in MAXBITS:
            got = group_encode.encode_words(blocks, mb)
            assert torch.equal(got, _general_codes(blocks, mb)), f"{kind}, maxbits {mb}"


def test_decoder_equals_general_decoder_at_every_size():
    for kind, blocks in _kinds().items():
        for mb in MAXBITS:
            codes = group_encode.encode_words(blocks, mb)
            got = window_decode.decode_words(codes, mb).view(torch.int32)
            ref = _general_decode(codes, mb).view(torch.int32)
            assert torch.equal(got, ref), f"{kind}, maxbits {mb}"


def test_decoder_of_arbitrary_codes_equals_general_decoder():
    """Any bit pattern, not only what the encoder writes (zfp decodes whatever it reads),
    including a nonzero block with an all-zero body, which runs past plane 0 (zfp stops there
    with budget left) at more than 32 bits of budget."""
    g = torch.Generator().manual_seed(5)
    for mb in MAXBITS:
        nw = -(-mb // 64)
        codes = torch.randint(-(1 << 62), 1 << 62, (1000, nw), generator=g) * 2 + 1
        codes[::10] = 0
        codes[::10, 0] = 2 * 140 + 1                    # flag 1, emax 13, no plane set
        if mb % 64:
            codes[:, -1] &= (1 << (mb % 64)) - 1
        got = window_decode.decode_words(codes, mb).view(torch.int32)
        ref = _general_decode(codes, mb).view(torch.int32)
        assert torch.equal(got, ref), f"maxbits {mb}"


def test_steps_cover_every_budget():
    """A full-window lookup consumes at least 10 bits (a plane codes in at most 7), which
    bounds the number of lookups per block."""
    _, _, meta = window_decode._tables_np()
    idx = (np.arange(5)[:, None] * window_decode._ROW + (1 << 16)
           + np.arange(1 << 16)[None, :])
    assert int((meta[idx] & 31).min()) == 10
    assert [window_decode._steps(b) for b in (1, 15, 16, 23, 25, 26, 55)] == [1, 1, 2, 2, 2, 3, 5]


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


def test_bad_sizes_fail_clearly():
    with pytest.raises(ValueError, match="maxbits=8"):
        group_encode.encode_words(torch.zeros(1, 4), 8)
    with pytest.raises(ValueError, match="maxbits=65; expected maxbits >= 9 and shape"):
        window_decode.decode_words(torch.zeros(1, 1, dtype=torch.int64), 65)


def test_rows_shorter_than_a_group_of_words():
    """A 1-block row at 24 bits is one stream word out of a 3-word group."""
    zfpy = pytest.importorskip("zfpy")
    x = np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)
    ours = zfp.compress(torch.from_numpy(x), 6, dims=1)
    assert ours.shape == (4, 8)
    for r in range(4):
        assert bytes(ours[r].numpy().tobytes()) == zfpy.compress_numpy(x[r], rate=6,
                                                                        write_header=False)
