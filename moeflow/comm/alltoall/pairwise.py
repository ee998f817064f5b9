"""``pairwise``: P rounds of send/recv (NCCL's all-to-all pattern; ScheMoE section 5, Eq. 15).

In round s rank i sends its block for rank (i+s) mod P and receives the block of rank (i-s) mod
P; round 0 is a local copy. Rounds run one after another, so this is the "sequential SR" baseline
that Pipe-A2A overlaps (Eq. 17).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.comm.alltoall.base import AllToAll, Pending, register_alltoall
from moeflow.comm.alltoall.blocks import offsets


@register_alltoall("pairwise")
class PairwiseAllToAll(AllToAll):
    def start(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              matrix: list[list[int]] | None = None) -> Pending:
        topo = self.topo
        if topo.ep_size == 1:
            return Pending(lambda: x)
        group, p, me = topo.ep_group, topo.ep_size, topo.ep_rank
        x = x.contiguous()
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        so, ro = offsets(send_splits), offsets(recv_splits)
        out.narrow(0, ro[me], recv_splits[me]).copy_(x.narrow(0, so[me], send_splits[me]))
        for s in range(1, p):
            dst, src = (me + s) % p, (me - s) % p
            ops = []
            if send_splits[dst]:
                ops.append(dist.P2POp(dist.isend, x.narrow(0, so[dst], send_splits[dst]),
                                      dist.get_global_rank(group, dst), group))
            if recv_splits[src]:
                ops.append(dist.P2POp(dist.irecv, out.narrow(0, ro[src], recv_splits[src]),
                                      dist.get_global_rank(group, src), group))
            for work in (dist.batch_isend_irecv(ops) if ops else []):
                work.wait()
        return Pending(lambda: out)
