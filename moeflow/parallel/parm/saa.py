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

Backward (both): the reduce-scatter (sum) over the MP group (AllGather's adjoint), then the
all-to-all the other way; sequential, not phased.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeflow.parallel.parm.collectives import (
    _all_gather, _padded, _reduce_scatter_rows, all_to_all, mp_all_gather)
from moeflow.parallel.parm.collectives import _all_to_all


def _blocks(sizes: list[int]) -> list[tuple[int, int]]:
    offs = np.cumsum([0] + list(sizes))
    return [(int(offs[i]), int(sizes[i])) for i in range(len(sizes))]


class _SAA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, send, recv, ag_sizes, me, mp_slots, mp_me, block_ranks, a2a_group,
                mp_group):
        ctx.save = (send, recv, ag_sizes, mp_me, a2a_group, mp_group)
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
        send, recv, ag_sizes, mp_me, a2a_group, mp_group = ctx.save
        mine = g
        if ag_sizes.shape[0] > 1:
            mine = _reduce_scatter_rows(g, [int(s) for s in ag_sizes.sum(1)], mp_me, mp_group)
        return (_all_to_all(mine, recv, send, a2a_group),) + (None,) * 9


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
