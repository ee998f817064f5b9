"""ZFP fixed-rate compression in vectorized torch (CPU, or any device torch runs on).

Pipeline per block (Lindstrom 2014; LLNL zfp's fixed-rate mode): one bit "block is nonzero",
the biased common exponent ``emax + 127`` in 8 bits, then the bit-plane code of the transformed
coefficients, ``maxbits`` bits in all (``maxbits = 4^d * rate``). Blocks follow each other with
no padding; the stream is a sequence of 64-bit little-endian words written LSB first, padded to a
whole word at the end, exactly as ``zfpy.compress_numpy(..., write_header=False)`` writes it.
"""

from __future__ import annotations

import math

import torch

from moeflow.comm.codecs.zfp import bitplane, group_encode, transform as T, window_decode



def _bit_weights(device) -> torch.Tensor:
    return (1 << torch.arange(8, device=device, dtype=torch.int64)).to(torch.int64)


def encode_blocks(blocks: torch.Tensor, d: int, maxbits: int) -> torch.Tensor:
    """float32 ``(B, 4^d)`` blocks -> ``(B, maxbits)`` uint8 stream bits of each block."""
    B = blocks.shape[0]
    emax = T.block_emax(blocks)
    e = emax + T.EBIAS                                            # 0 <=> all-zero block
    nonzero = e != 0
    u = T.fwd_order(T.fwd_xform(T.fwd_cast(blocks, emax), d), d)
    u = torch.where(nonzero.unsqueeze(1), u, torch.zeros_like(u))
    head = ((2 * e.to(torch.int64) + 1) * nonzero.long()).unsqueeze(1)
    hbits = ((head >> torch.arange(1 + T.EBITS, device=blocks.device)) & 1).to(torch.uint8)
    budget = maxbits - 1 - T.EBITS
    body = bitplane.encode_planes(u, budget) if budget > 0 else hbits[:, :0]
    return torch.cat([hbits, body], dim=1).reshape(B, maxbits)


def decode_blocks(bits: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of :func:`encode_blocks`: ``(B, maxbits)`` uint8 -> float32 ``(B, 4^d)``."""
    S = 4 ** d
    b64 = bits[:, : 1 + T.EBITS].to(torch.int64)
    nonzero = b64[:, 0].bool()
    e = (b64[:, 1:] << torch.arange(T.EBITS, device=bits.device)).sum(1)
    emax = (e - T.EBIAS).to(torch.int32)
    if bits.shape[1] > 1 + T.EBITS:
        u = bitplane.decode_planes(bits[:, 1 + T.EBITS:], S)
    else:
        u = torch.zeros(bits.shape[0], S, dtype=torch.int64, device=bits.device)
    f = T.inv_cast(T.inv_xform(T.inv_order(u, d), d), emax)
    return torch.where(nonzero.unsqueeze(1), f, torch.zeros_like(f))


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``(..., nbits)`` uint8 bits -> ``(..., 8 * ceil(nbits / 64))`` uint8 bytes (LSB first,
    padded to whole 64-bit words like zfp's bit stream)."""
    nbits = bits.shape[-1]
    pad = (-nbits) % 64
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    g = bits.reshape(*bits.shape[:-1], -1, 8).to(torch.int64)
    return (g * _bit_weights(bits.device)).sum(-1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``(..., nbytes)`` uint8 -> ``(..., nbits)`` uint8 bits."""
    b = (data.to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=data.device)) & 1
    return b.reshape(*data.shape[:-1], -1)[..., :nbits].to(torch.uint8)


def stream_bytes(nblocks: int, maxbits: int) -> int:
    """Size of a zfp fixed-rate stream of ``nblocks`` blocks, padded to 64-bit words."""
    return 8 * (-(-nblocks * maxbits // 64))


def compress(a: torch.Tensor, d: int, maxbits: int) -> torch.Tensor:
    """float32 array whose last ``d`` dims form one zfp array per leading index ->
    uint8 ``(*lead, stream_bytes)``: each slice's own zfp stream."""
    lead = a.shape[: a.dim() - d]
    blocks = T.to_blocks(a, d)
    bits = encode_blocks(blocks, d, maxbits)
    nslices = math.prod(lead)
    per = blocks.shape[0] // max(nslices, 1)
    return pack_bits(bits.reshape(nslices, per * maxbits)).reshape(*lead, -1)


def decompress(data: torch.Tensor, shape: tuple[int, ...], d: int, maxbits: int) -> torch.Tensor:
    """Inverse of :func:`compress` (``shape`` is the original array's shape)."""
    lead = shape[: len(shape) - d]
    per = T.blocks_per_array(shape, d)
    nslices = math.prod(lead)
    bits = unpack_bits(data.reshape(nslices, -1), per * maxbits).reshape(nslices * per, maxbits)
    return T.from_blocks(decode_blocks(bits, d), tuple(shape), d)


# ------------------------------------------------------------- 1-D fast path (table coder)


CHUNK = 1 << 17          # blocks per step of the 1-D path: keeps its temporaries in cache


def _mask(nbits: int) -> int:
    """The low ``nbits`` bits set, as an int64 constant (-1 for all 64)."""
    return -1 if nbits >= 64 else (1 << nbits) - 1


def _groups(per: int, maxbits: int) -> tuple[int, int, int]:
    """(blocks per group, 64-bit words per group, groups per slice): ``g`` blocks of ``maxbits``
    bits fill a whole number of stream words, so within a group every code starts at a fixed
    word and bit."""
    g = 64 // math.gcd(maxbits, 64)
    return g, g * maxbits // 64, -(-per // g)


def pack_codes(codes: torch.Tensor, nslices: int, per: int, maxbits: int) -> torch.Tensor:
    """int64 block codes ``(nslices * per, nw)`` (word q = code bits 64 q..) -> each slice's
    stream as int64 words ``(nslices, ceil(per * maxbits / 64))``: codes back to back, LSB
    first, zero padded (zfp's stream)."""
    nw = codes.shape[1]
    g, gw, ng = _groups(per, maxbits)
    c = codes.reshape(nslices, per, nw)
    if ng * g != per:                                    # a last, partial group: zero codes
        c = torch.nn.functional.pad(c, (0, 0, 0, ng * g - per))
    c = c.reshape(nslices, ng, g, nw)
    out = torch.zeros(nslices, ng, gw, dtype=torch.int64, device=codes.device)
    for j in range(g):
        for q in range(nw):
            nb = min(64, maxbits - 64 * q)               # bits in this code word
            w, sh = divmod(j * maxbits + 64 * q, 64)
            v = c[:, :, j, q]
            out[:, :, w] |= v << sh
            if sh + nb > 64:                             # the rest spills into the next word
                out[:, :, w + 1] |= (v >> (64 - sh)) & _mask(sh + nb - 64)
    return out.reshape(nslices, ng * gw)[:, : -(-per * maxbits // 64)]


def unpack_codes(words: torch.Tensor, per: int, maxbits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``(nslices, nwords)`` -> ``(nslices * per, nw)``."""
    nslices = words.shape[0]
    nw = -(-maxbits // 64)
    g, gw, ng = _groups(per, maxbits)
    if ng * gw != words.shape[1]:
        words = torch.nn.functional.pad(words, (0, ng * gw - words.shape[1]))
    W = words.reshape(nslices, ng, gw)
    codes = torch.empty(nslices, ng, g, nw, dtype=torch.int64, device=words.device)
    for j in range(g):
        for q in range(nw):
            nb = min(64, maxbits - 64 * q)
            w, sh = divmod(j * maxbits + 64 * q, 64)
            v = ((W[:, :, w] >> sh) & _mask(64 - sh)) if sh else W[:, :, w]
            if sh + nb > 64:
                v = v | ((W[:, :, w + 1] & _mask(sh + nb - 64)) << (64 - sh))
            codes[:, :, j, q] = v & _mask(nb)
    return codes.reshape(nslices, ng * g, nw)[:, :per].reshape(-1, nw)


def compress_1d(a: torch.Tensor, maxbits: int) -> torch.Tensor:
    """Like ``compress(a, 1, maxbits)`` (each row of ``a`` its own stream), by the table coder."""
    lead = a.shape[:-1]
    blocks = T.to_blocks(a, 1)
    per = -(-a.shape[-1] // 4)
    nslices = blocks.shape[0] // per
    nbytes = stream_bytes(per, maxbits)
    codes = torch.cat([group_encode.encode_words(blocks[i:i + CHUNK], maxbits)
                       for i in range(0, blocks.shape[0], CHUNK)])
    words = pack_codes(codes, nslices, per, maxbits)
    return words.contiguous().view(torch.uint8).reshape(*lead, nbytes)


def decompress_1d(data: torch.Tensor, shape: tuple[int, ...], maxbits: int) -> torch.Tensor:
    """Inverse of :func:`compress_1d`."""
    per = -(-shape[-1] // 4)
    nbytes = data.shape[-1]
    rows = data.reshape(-1, nbytes).contiguous()
    if rows.storage_offset() % 8:                        # int64 view needs 8-byte alignment
        rows = rows.clone()
    words = rows.view(torch.int64)
    codes = unpack_codes(words, per, maxbits)
    blocks = torch.cat([window_decode.decode_words(codes[i:i + CHUNK], maxbits)
                        for i in range(0, codes.shape[0], CHUNK)])
    return T.from_blocks(blocks, tuple(shape), 1)
