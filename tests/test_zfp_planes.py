"""The vectorized 2-D/3-D ZFP coder (plane_encode / plane_decode / bitops) against the general
bit-plane coder of torch_backend. test_zfp_numba.py holds both equal to the compiled CPU coder,
which test_zfp.py holds to zfpy byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow.comm.codecs.zfp import bitops, plane_decode, plane_encode, torch_backend
from moeflow.comm.codecs.zfp import transform as T
from tests.test_zfp import _kinds

# rate 40 in 2-D gives a 631-bit body, more than 32 planes need: zfp stops after plane 0
RATES = {2: [1, 3.5, 8, 16, 32, 40], 3: [0.5, 2, 8, 20, 32]}
SHAPES = {2: [(9, 11), (1, 1), (2, 3, 8)], 3: [(5, 6, 7), (3, 9, 2)]}


def _naive_planes(u: torch.Tensor, S: int) -> list[torch.Tensor]:
    return [sum((((u[:, i].long() >> k) & 1) << i) for i in range(S)) for k in range(31, -1, -1)]


@pytest.mark.parametrize("S", [16, 64])
def test_bit_plane_transpose_matches_definition_and_inverts(S):
    g = torch.Generator().manual_seed(S)
    u = torch.randint(-2 ** 31, 2 ** 31 - 1, (7, S), generator=g).to(torch.int32)
    u[0] = 0
    u[1] = -1
    hi, lo = bitops.to_planes(u, True), bitops.to_planes(u, False)
    got = torch.cat([hi, lo], 1).long()
    if S == 16:
        got &= 0xFFFF
    for j, ref in enumerate(_naive_planes(u, S)):
        assert torch.equal(got[:, j], ref), f"plane {31 - j}"
    assert torch.equal(bitops.from_planes(hi, lo), u)


def test_copy_bits_and_read64_match_python_integers():
    rng = np.random.default_rng(3)
    B, ns, nd = 64, 5, 6
    src = torch.from_numpy(rng.integers(-2 ** 63, 2 ** 63 - 1, (B, ns), dtype=np.int64))
    so = torch.from_numpy(rng.integers(0, 64 * ns - 1, B))
    length = torch.minimum(torch.from_numpy(rng.integers(0, 200, B)), 64 * ns - so)
    do = torch.from_numpy(rng.integers(0, 64 * nd, B))
    length = torch.minimum(length, 64 * nd - do)
    dst = torch.zeros(B, nd, dtype=torch.int64)
    bitops.copy_bits(dst, do, src, so, length, 200)
    for b in range(B):
        s = sum((int(v) & (2 ** 64 - 1)) << (64 * q) for q, v in enumerate(src[b].tolist()))
        piece = (s >> int(so[b])) & ((1 << int(length[b])) - 1)
        want = piece << int(do[b])
        got = sum((int(v) & (2 ** 64 - 1)) << (64 * q) for q, v in enumerate(dst[b].tolist()))
        assert got == want, b
        r = int(bitops.read64(src[b:b + 1], so[b:b + 1])) & (2 ** 64 - 1)
        assert r & ((1 << min(64, 64 * ns - int(so[b]))) - 1) == (s >> int(so[b])) & (2 ** 64 - 1)


@pytest.mark.parametrize("d", [2, 3])
def test_plane_coder_equals_general_coder(d):
    for shape in SHAPES[d]:
        for kind, a in _kinds(shape).items():
            x = torch.from_numpy(np.asarray(a, np.float32))
            for rate in RATES[d]:
                mb = T.maxbits_for(rate, d)
                ref = torch_backend.compress(x, d, mb)
                got = plane_encode.compress(x, d, mb, chunk=5)      # several chunks
                assert torch.equal(got, ref), (shape, kind, rate)
                dec = plane_decode.decompress(got, shape, d, mb, chunk=3)
                want = torch_backend.decompress(ref, shape, d, mb)
                assert torch.equal(dec.view(torch.int32), want.view(torch.int32)), \
                    (shape, kind, rate)


def random_streams(shape, d, seed):
    """(rate, maxbits, stream) for random bit strings sized for ``shape``: dense ones and
    sparser ones (bytes and-ed together), rates 1-32."""
    g = torch.Generator().manual_seed(seed)
    for rate in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        mb = T.maxbits_for(rate, d)
        nb = torch_backend.stream_bytes(T.blocks_per_array(shape, d), mb)
        for t in range(6):
            data = torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g)
            for _ in range(t % 3):                          # sparser bit patterns too
                data &= torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g)
            yield rate, mb, data


@pytest.mark.parametrize("d", [2, 3])
def test_decoder_follows_zfp_on_arbitrary_streams(d):
    """Any bit string is a stream zfp decodes somehow (cut-short scans, the implied last
    coefficient, planes past the budget): the plane decoder must agree on random ones."""
    shape = (8, 12) if d == 2 else (4, 8, 8)
    for rate, mb, data in random_streams(shape, d, seed=d):
        ref = torch_backend.decompress(data, shape, d, mb)
        got = plane_decode.decompress(data, shape, d, mb)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), rate


def test_bad_block_shapes_fail_clearly():
    with pytest.raises(ValueError, match="expected d in"):
        plane_encode.encode_words(torch.zeros(3, 16), 3, 100)
    with pytest.raises(ValueError, match="maxbits"):
        plane_encode.encode_words(torch.zeros(3, 16), 2, 8)
    with pytest.raises(ValueError, match="shape"):
        plane_decode.decode_words(torch.zeros(3, 1, dtype=torch.int64), 2, 128)
