"""``pipe``: Pipe-A2A (ScheMoE section 5, Fig. 7).

The P send/recv pairs of rank i are split by link class: pairs inside the node run as an
all-to-all on the intra-node group (the "Intra-Stream"), pairs across nodes as an all-to-all
on a second world group with the intra-node sizes set to zero (the "Inter-Stream"). Both are
issued asynchronously, so they run concurrently (two process groups are two lanes); the time
approaches ``max(M t1, (P-M) t2)`` (Eq. 16) instead of their sum (Eq. 17). The split sizes
of the two streams are :func:`moeflow.comm.alltoall.phases.pipe_phases` (which the step simulator
models too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.comm.alltoall.base import AllToAll, Pending, register_alltoall
from moeflow.comm.alltoall.blocks import offsets, take
from moeflow.comm.alltoall.hierarchy import require_nodes
from moeflow.comm.alltoall.phases import pipe_phases


@register_alltoall("pipe")
class PipeAllToAll(AllToAll):
    @classmethod
    def check_topology(cls, topo) -> None:
        require_nodes("pipe", topo)

    def start(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              matrix: list[list[int]] | None = None) -> Pending:
        topo = self.topo
        L, n = topo.local_size, topo.node_rank
        P = topo.world_size
        local = range(n * L, (n + 1) * L)
        x = x.contiguous()
        tail = tuple(x.shape[1:])
        intra, inter = pipe_phases(send_splits, recv_splits, topo.num_nodes, L, n)
        # Intra-Stream: the blocks for this node's ranks, in local order
        intra_x = take(x, send_splits, list(local))
        intra_send, intra_recv = intra.send, intra.recv
        intra_out = x.new_empty((sum(intra_recv),) + tail)
        # Inter-Stream: every other block; this node's ranks get zero rows
        inter_send, inter_recv = inter.send, inter.recv
        inter_x = take(x, send_splits, [d for d in range(P) if d not in local])
        inter_out = x.new_empty((sum(inter_recv),) + tail)
        works = []
        if L > 1:
            works.append(dist.all_to_all_single(intra_out, intra_x, intra_recv, intra_send,
                                                group=topo.intra_node_group, async_op=True))
        else:
            intra_out = intra_x
        works.append(dist.all_to_all_single(inter_out, inter_x, inter_recv, inter_send,
                                            group=topo.lane_group, async_op=True))

        def wait() -> torch.Tensor:
            for w in works:
                w.wait()
            # merge into source-rank order
            io, eo = offsets(intra_recv), offsets(inter_recv)
            parts = []
            for s in range(P):
                if recv_splits[s] == 0:
                    continue
                if s in local:
                    parts.append(intra_out.narrow(0, io[s - n * L], recv_splits[s]))
                else:
                    parts.append(inter_out.narrow(0, eo[s], recv_splits[s]))
            return torch.cat(parts) if parts else x.new_empty((0,) + tail)
        return Pending(wait)
