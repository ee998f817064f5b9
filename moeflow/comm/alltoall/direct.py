"""``direct``: one ``all_to_all_single`` with split sizes over the expert-parallel group.

The baseline every other algorithm is measured against (NCCL's and gloo's own all-to-all).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.comm.alltoall.base import AllToAll, Pending, register_alltoall


@register_alltoall("direct")
class DirectAllToAll(AllToAll):
    def start(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              matrix: list[list[int]] | None = None) -> Pending:
        if self.topo.ep_size == 1:
            return Pending(lambda: x)
        x = x.contiguous()
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        work = dist.all_to_all_single(out, x, output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits),
                                      group=self.topo.ep_group, async_op=True)

        def wait() -> torch.Tensor:
            work.wait()
            return out
        return Pending(wait, work)
