"""Simultaneous AlltoAll and AllGather (SAA, Parm Section III-D, Fig. 5), and AAS.

In S2 the second EP&ESP-AlltoAll (inter-node dominated) is followed by the MP-AllGather
(intra-node). SAA runs them at once: the all-to-all is cut into ``u`` phases (``u`` ranks in
the EP&ESP block); in phase t rank q sends to ``q + t`` and receives from ``q - t`` (mod u,
pairwise ``isend`` / ``irecv``, Fig. 5's red slices), and the slice it received in phase t is
the input of the MP-AllGather of phase t + 1 (blue). The AllGather of phase t + 1 and the
all-to-all of phase t + 1 are issued together, on two process groups (the MP group and the
EP&ESP group: two gloo contexts, or two NCCL communicators with their own streams), and waited
for together. Every rank issues the same sequence on each group (phase order), so the two
groups' collectives are matched on every rank, with no thread of their own.

AAS (:func:`aas`) is the sequential version: the whole all-to-all, then the whole AllGather.
Both return, for every MP rank m of the group in MP order, the rows m received from each slot
of its EP&ESP block, in slot order (what the local combine reads).

Backward of SAA, phased too (Fig. 5 in reverse, the adjoint of each phase): phase t's
AllGather has for adjoint a reduce-scatter (sum over the MP group) of the gradient blocks of
the slices gathered in that phase (MP rank m's slice from slot ``slot_m - t``), which hands
this rank the gradient of the slice it received in phase t, from slot ``me - t``; phase t's
pairwise exchange has for adjoint the pairwise exchange the other way (send that gradient to
``me - t``, receive the gradient of the rows sent to ``me + t``). The phases run in reverse
order, u - 1 first: the reduce-scatter of phase t runs at once with the reverse exchange of
phase t + 1 (MP group and EP&ESP group), and phase 0's exchange is a local copy, so the
backward has u communication steps as the forward has. Every rank issues the reduce-scatters
on the MP group and the exchanges on the EP&ESP group in that same phase order. The sums are
the ones of one whole reduce-scatter (each element is the sum of the same N_MP values), so the
gradients equal AAS's sequential backward (bit for bit on the tested MP = 2 layouts: a sum of
two numbers does not depend on order). With N_MP = 1 there is nothing to overlap: one
all-to-all back.

AAS's backward stays sequential (the comparison): the reduce-scatter over the MP group
(AllGather's adjoint), then the all-to-all the other way.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeflow.strategies.parm.collectives import (
    _all_gather, _padded, _reduce_scatter, all_to_all, mp_all_gather)
from moeflow.strategies.parm.collectives import _all_to_all


def _blocks(sizes: list[int]) -> list[tuple[int, int]]:
    offs = np.cumsum([0] + list(sizes))
    return [(int(offs[i]), int(sizes[i])) for i in range(len(sizes))]


class _SAA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, send, recv, ag_sizes, me, mp_slots, mp_me, block_ranks, a2a_group,
                mp_group):
        ctx.save = (send, recv, ag_sizes, me, mp_slots, mp_me, block_ranks, a2a_group, mp_group)
        u, mp = len(send), len(mp_slots)
        out_blocks = _blocks(send)
        received: list[torch.Tensor | None] = [None] * u
        gathered = [[None] * u for _ in range(mp)]     # gathered[m][p]: rows m got from p
        tail = tuple(y.shape[1:])
        for t in range(u + 1):
            reqs, ag = [], None
            if t < u:                               # all-to-all phase t (Fig. 5, red)
                dst, src = (me + t) % u, (me - t) % u
                lo, n = out_blocks[dst]
                if t == 0:
                    received[src] = y.narrow(0, lo, n)
                else:
                    buf = y.new_empty((recv[src],) + tail)
                    ops = [dist.P2POp(dist.isend, y.narrow(0, lo, n).contiguous(),
                                      block_ranks[dst], a2a_group),
                           dist.P2POp(dist.irecv, buf, block_ranks[src], a2a_group)]
                    reqs = dist.batch_isend_irecv(ops)
                    received[src] = buf
            if t >= 1 and mp > 1:                   # AllGather of phase t-1's slice (blue)
                srcs = [(mp_slots[m] - (t - 1)) % u for m in range(mp)]
                sizes = [int(ag_sizes[m][srcs[m]]) for m in range(mp)]
                top = max(sizes)
                ag_buf = y.new_empty((mp * top,) + tail)
                ag = (_all_gather(ag_buf, _padded(received[srcs[mp_me]], top),
                                  group=mp_group, async_op=True), ag_buf, srcs, sizes, top)
            for r in reqs:
                r.wait()
            if ag is not None:
                work, ag_buf, srcs, sizes, top = ag
                work.wait()
                for m in range(mp):
                    gathered[m][srcs[m]] = ag_buf[m * top:m * top + sizes[m]]
        if mp == 1:
            gathered[0] = received
        return torch.cat([gathered[m][p] for m in range(mp) for p in range(u)])

    @staticmethod
    def backward(ctx, g):
        send, recv, ag_sizes, me, mp_slots, mp_me, block_ranks, a2a_group, mp_group = ctx.save
        if len(mp_slots) == 1:                      # no AllGather: one all-to-all back
            return (_all_to_all(g, recv, send, a2a_group),) + (None,) * 9
        return (_saa_backward(g.contiguous(), send, recv, ag_sizes, me, mp_slots, mp_me,
                              block_ranks, a2a_group, mp_group),) + (None,) * 9


def _saa_backward(g: torch.Tensor, send: list[int], recv: list[int], ag_sizes: np.ndarray,
                  me: int, mp_slots: list[int], mp_me: int, block_ranks: list[int], a2a_group,
                  mp_group) -> torch.Tensor:
    """SAA's phased backward (module docstring): phases u - 1 .. 0; in step t the
    reduce-scatter of phase t (MP group) runs with the reverse exchange of phase t + 1
    (EP&ESP group). ``g``: the output's gradient, blocks ``ag_sizes[m][p]`` in (m, p) order."""
    u, mp = len(send), len(mp_slots)
    tail = tuple(g.shape[1:])
    offs = np.cumsum([0] + [int(n) for n in ag_sizes.reshape(-1)])
    out_blocks = _blocks(send)
    gy = g.new_empty((sum(send),) + tail)
    pending = None                                  # (phase, gradient of its received slice)
    for t in range(u - 1, -2, -1):
        rs = None
        if t >= 0:                                  # reduce-scatter of phase t (MP group)
            srcs = [(mp_slots[m] - t) % u for m in range(mp)]
            sizes = [int(ag_sizes[m][srcs[m]]) for m in range(mp)]
            top = max(sizes)
            blocks = [g.narrow(0, int(offs[m * u + srcs[m]]), sizes[m]) for m in range(mp)]
            rs_buf = g.new_empty((top,) + tail)
            rs = (_reduce_scatter(rs_buf, torch.cat([_padded(b, top) for b in blocks]),
                                  group=mp_group, async_op=True), rs_buf, sizes[mp_me])
        reqs = []
        if pending is not None:                     # reverse exchange of phase t + 1
            s, got = pending
            src, dst = (me - s) % u, (me + s) % u
            lo, n = out_blocks[dst]
            if s == 0:
                gy.narrow(0, lo, n).copy_(got)
            else:
                ops = [dist.P2POp(dist.isend, got.contiguous(), block_ranks[src], a2a_group),
                       dist.P2POp(dist.irecv, gy.narrow(0, lo, n), block_ranks[dst],
                                  a2a_group)]
                reqs = dist.batch_isend_irecv(ops)
        for r in reqs:
            r.wait()
        pending = None
        if rs is not None:
            work, rs_buf, n = rs
            work.wait()
            pending = (t, rs_buf[:n])
    return gy


def saa(y: torch.Tensor, send: list[int], recv: list[int], ag_sizes: np.ndarray, me: int,
        mp_slots: list[int], mp_me: int, block_ranks: list[int], a2a_group, mp_group
        ) -> torch.Tensor:
    """SAA: all-to-all of ``y`` over the EP&ESP block (``send[p]`` rows to slot p, ``recv[p]``
    from it; this rank is slot ``me``, slot p is global rank ``block_ranks[p]``) overlapped with
    the MP-AllGather of the received slices. ``ag_sizes[m][p]``: rows MP rank m (at slot
    ``mp_slots[m]``; this rank is ``mp_me``) receives from slot p. Differentiable."""
    return _SAA.apply(y, list(send), list(recv), np.asarray(ag_sizes), me, list(mp_slots),
                      mp_me, list(block_ranks), a2a_group, mp_group)


def aas(y: torch.Tensor, send: list[int], recv: list[int], ag_sizes: np.ndarray, me: int,
        mp_slots: list[int], mp_me: int, block_ranks: list[int], a2a_group, mp_group
        ) -> torch.Tensor:
    """AAS: the same result as :func:`saa`, the all-to-all then the AllGather."""
    got = all_to_all(y, send, recv, a2a_group)
    if len(mp_slots) == 1:
        return got
    return mp_all_gather(got, [int(s) for s in np.asarray(ag_sizes).sum(1)], mp_me, mp_group)
