"""The slow reference ZFP coder the tests hold the fast ones to, in vectorized torch: zfp's
embedded bit-plane coder with group tests (Lindstrom 2014, section 3.4; LLNL zfp's
``encode_ints`` / ``decode_ints`` in fixed-rate mode; the ZFP of ScheMoE section 3.1) run in
lockstep over all blocks (a Python loop over planes and, inside, over group tests), and the
whole pipeline around it (:func:`compress` / :func:`decompress`, with
:mod:`moeflow.comm.codecs.zfp.transform`): per block a "nonzero" bit, ``emax + 127`` in 8 bits,
then the plane code, ``maxbits`` bits in all; each array's stream is 64-bit little-endian words,
LSB first, zero padded (zfpy's bytes).
"""

from __future__ import annotations

import math

import torch

from moeflow.comm.codecs.zfp import transform


def _next_one(bits: torch.Tensor, limit: int) -> torch.Tensor:
    """``nxt[b, t]`` = smallest ``t' >= t`` with ``bits[b, t'] == 1``, else ``limit``;
    shape ``(B, T + 1)`` (the extra column answers ``t = T``)."""
    B, T = bits.shape
    ar = torch.arange(T, device=bits.device, dtype=torch.int64)
    cand = torch.where(bits.bool(), ar, torch.full_like(ar, limit))
    nxt = torch.flip(torch.cummin(torch.flip(cand, [1]), dim=1).values, [1])
    return torch.cat([nxt, torch.full((B, 1), limit, dtype=torch.int64, device=bits.device)], 1)


def encode_planes(u: torch.Tensor, budget: int) -> torch.Tensor:
    """Code int64 ``u: (B, S)`` (values in [0, 2^32)) into ``(B, budget)`` uint8 bits."""
    B, S = u.shape
    dev = u.device
    out = torch.zeros(B, budget + 1, dtype=torch.uint8, device=dev)   # column `budget` = sink
    sink = torch.full((B,), budget, dtype=torch.int64, device=dev)
    pos = torch.zeros(B, dtype=torch.int64, device=dev)
    n = torch.zeros(B, dtype=torch.int64, device=dev)
    ar = torch.arange(S, device=dev, dtype=torch.int64)
    one = torch.ones(B, 1, dtype=torch.uint8, device=dev)

    def put(where_, mask):
        out.scatter_(1, torch.where(mask & (where_ < budget), where_, sink).unsqueeze(1), one)

    for k in range(31, -1, -1):
        live = pos < budget
        if not bool(live.any()):
            break
        plane = (u >> k) & 1                                       # (B, S)
        # verbatim bits of the n significant coefficients
        m = torch.minimum(n, (budget - pos).clamp(min=0))
        if bool((m > 0).any()):
            tgt = pos.unsqueeze(1) + ar
            ok = (ar < m.unsqueeze(1)) & plane.bool()
            out.scatter_(1, torch.where(ok, tgt, budget), 1)
        pos = pos + m
        # unary run-length code of the rest
        nxt = _next_one(plane, S)
        active = (n < S) & (pos < budget)
        while bool(active.any()):
            p = nxt.gather(1, n.clamp(max=S).unsqueeze(1)).squeeze(1)
            g = p < S
            put(pos, active & g)                                   # group test bit
            pos = pos + active.long()
            act = active & g
            nz = p - n
            last = p < S - 1
            put(pos + nz, act & last)                              # the one-bit ending the run
            pos = torch.where(act, pos + nz + last.long(), pos)
            n = torch.where(act, p + 1, n)
            active = act & (n < S) & (pos < budget)
    return out[:, :budget]


def decode_planes(bits: torch.Tensor, S: int) -> torch.Tensor:
    """Inverse of :func:`encode_planes`: ``(B, budget)`` bits -> int64 ``(B, S)``."""
    B, budget = bits.shape
    dev = bits.device
    bits = bits.to(torch.int64)
    padded = torch.cat([bits, torch.zeros(B, S + 1, dtype=torch.int64, device=dev)], 1)
    nxt = _next_one(bits, budget)                                   # (B, budget + 1)
    u = torch.zeros(B, S, dtype=torch.int64, device=dev)
    pos = torch.zeros(B, dtype=torch.int64, device=dev)
    n = torch.zeros(B, dtype=torch.int64, device=dev)
    ar = torch.arange(S, device=dev, dtype=torch.int64)
    for k in range(31, -1, -1):
        if not bool((pos < budget).any()):
            break
        m = torch.minimum(n, (budget - pos).clamp(min=0))
        if bool((m > 0).any()):
            vb = padded.gather(1, (pos.unsqueeze(1) + ar).clamp(max=budget + S))
            u += (vb & (ar < m.unsqueeze(1)).long()) << k
        pos = pos + m
        active = (n < S) & (pos < budget)
        while bool(active.any()):
            g = padded.gather(1, pos.clamp(max=budget).unsqueeze(1)).squeeze(1).bool()
            pos = pos + active.long()
            act = active & g
            r = (budget - pos).clamp(min=0)
            zeros = nxt.gather(1, pos.clamp(max=budget).unsqueeze(1)).squeeze(1) - pos
            smax = S - 1 - n
            z = torch.minimum(torch.minimum(zeros, smax), r)
            found = (zeros < smax) & (zeros < r)                   # read the one-bit itself
            p = n + z
            u.scatter_add_(1, torch.where(act, p, 0).unsqueeze(1),
                           (act.long() << k).unsqueeze(1))
            pos = torch.where(act, pos + z + found.long(), pos)
            n = torch.where(act, p + 1, n)
            active = act & (n < S) & (pos < budget)
    return u


# ------------------------------------------------------------------ the whole pipeline


def encode_blocks(blocks: torch.Tensor, d: int, maxbits: int) -> torch.Tensor:
    """float32 ``(B, 4^d)`` blocks -> ``(B, maxbits)`` uint8 stream bits of each block."""
    emax = transform.block_emax(blocks)
    e = emax + transform.EBIAS                                            # 0 <=> all-zero block
    nonzero = e != 0
    u = transform.fwd_order(transform.fwd_xform(transform.fwd_cast(blocks, emax), d), d)
    u = torch.where(nonzero.unsqueeze(1), u, torch.zeros_like(u))
    head = ((2 * e.to(torch.int64) + 1) * nonzero.long()).unsqueeze(1)
    hbits = ((head >> torch.arange(1 + transform.EBITS, device=blocks.device)) & 1).to(torch.uint8)
    budget = maxbits - 1 - transform.EBITS
    body = encode_planes(u, budget) if budget > 0 else hbits[:, :0]
    return torch.cat([hbits, body], dim=1)


def decode_blocks(bits: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of :func:`encode_blocks`: ``(B, maxbits)`` uint8 -> float32 ``(B, 4^d)``."""
    b64 = bits[:, : 1 + transform.EBITS].to(torch.int64)
    nonzero = b64[:, 0].bool()
    e = (b64[:, 1:] << torch.arange(transform.EBITS, device=bits.device)).sum(1)
    emax = e - transform.EBIAS
    if bits.shape[1] > 1 + transform.EBITS:
        u = decode_planes(bits[:, 1 + transform.EBITS:], 4 ** d)
    else:
        u = torch.zeros(bits.shape[0], 4 ** d, dtype=torch.int64, device=bits.device)
    f = transform.inv_cast(transform.inv_xform(transform.inv_order(u, d), d), emax.to(torch.int32))
    return torch.where(nonzero.unsqueeze(1), f, torch.zeros_like(f))


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``(..., nbits)`` uint8 bits -> ``(..., 8 * ceil(nbits / 64))`` uint8 bytes (LSB first,
    padded to whole 64-bit words like zfp's bit stream)."""
    bits = torch.nn.functional.pad(bits, (0, (-bits.shape[-1]) % 64))
    g = bits.reshape(*bits.shape[:-1], -1, 8).to(torch.int64)
    return (g << torch.arange(8, device=bits.device)).sum(-1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``(..., nbytes)`` uint8 -> ``(..., nbits)`` uint8 bits."""
    b = (data.to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=data.device)) & 1
    return b.reshape(*data.shape[:-1], -1)[..., :nbits].to(torch.uint8)


def compress(a: torch.Tensor, d: int, maxbits: int) -> torch.Tensor:
    """float32 array whose last ``d`` dims form one zfp array per leading index ->
    uint8 ``(*lead, stream_bytes)``: each slice's own zfp stream."""
    lead = a.shape[: a.dim() - d]
    bits = encode_blocks(transform.to_blocks(a, d), d, maxbits)
    return pack_bits(bits.reshape(math.prod(lead), -1)).reshape(*lead, -1)


def decompress(data: torch.Tensor, shape: tuple[int, ...], d: int, maxbits: int) -> torch.Tensor:
    """Inverse of :func:`compress` (``shape`` is the original array's shape)."""
    nslices = math.prod(shape[: len(shape) - d])
    per = transform.blocks_per_array(shape, d)
    bits = unpack_bits(data.reshape(nslices, -1), per * maxbits).reshape(nslices * per, maxbits)
    return transform.from_blocks(decode_blocks(bits, d), tuple(shape), d)
