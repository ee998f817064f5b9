"""ZFP's embedded bit-plane coder with group tests, vectorized over blocks (Lindstrom 2014,
section 3.4; the coder of LLNL zfp's ``encode_ints`` / ``decode_ints`` in fixed-rate mode).

Each block's ``S = 4^d`` negabinary coefficients are coded one bit plane at a time, from bit 31
down. With ``n`` the number of coefficients already found significant, a plane is coded as its
first ``n`` bits verbatim, then a unary run-length code of the rest: a group test bit (is there
any one-bit left?), and if so the zeros up to the next one-bit and that one (the last position's
one is implied). The code stops at exactly ``budget`` bits (fixed rate); the decoder mirrors the
encoder bit for bit, including zfp's rule that a scan cut short by the budget still sets the
bit it stopped at.

Here every block runs the coder in lockstep: a Python loop over planes, and inside a plane over
"segments" (one group test + one run), each step a handful of tensor ops over all blocks. Bits
live in a ``(blocks, budget)`` uint8 tensor (LSB-first stream order). Zero bits are never
written (the buffer starts zeroed), so the encoder only scatters one-bits.
"""

from __future__ import annotations

import torch


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
