"""``hier2d``: the 2D-hierarchical all-to-all of Tutel / DeepSpeed-MoE (ScheMoE section 6, "2DH").

Rank (n, l) = node n, local rank l; ranks are numbered g = n*L + l.
1. Layout transform: reorder the send blocks from destination order (n', l') to (l', n').
2. Intra-node all-to-all: local rank l' receives, from every local rank l of its node, the
   blocks for (n', l') for all n'.
3. Layout transform: reorder the received blocks from (l, n') to (n', l).
4. Inter-node all-to-all among the ranks with the same local rank: node n' receives its blocks.
The result is in source-rank order (n, l), as the interface requires. Only N-1 inter-node
messages per rank (instead of P - L), each L times larger. The split sizes of steps 2 and 4 are
:func:`moeflow.comm.alltoall.phases.hier2d_phases` (which the step simulator models too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.comm.alltoall.base import AllToAll, Pending, register_alltoall
from moeflow.comm.alltoall.blocks import take
from moeflow.comm.alltoall.hierarchy import Layout, require_nodes
from moeflow.comm.alltoall.phases import hier2d_phases


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


@register_alltoall("hier2d")
class Hier2DAllToAll(AllToAll):
    @classmethod
    def check_topology(cls, topo) -> None:
        require_nodes("hier2d", topo)

    def start(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              matrix: list[list[int]] | None = None) -> Pending:
        topo = self.topo
        lay = Layout.of(topo, send_splits, x.device, matrix)
        N, L, n, l, S, g = lay.N, lay.L, lay.n, lay.l, lay.S, lay.g
        # 1-2: to local rank l' go the blocks for (n', l'), n' ascending
        step1 = take(x, send_splits, [g(n2, l2) for l2 in range(L) for n2 in range(N)])
        intra, inter = hier2d_phases(S, N, L, n, l)
        got1 = _a2a(step1, intra.send, intra.recv, topo.intra_node_group) if L > 1 else step1
        # 3: received blocks are (source l1, dest node n2); regroup by dest node
        sizes1 = [S[g(n, l1)][g(n2, l)] for l1 in range(L) for n2 in range(N)]
        step2 = take(got1, sizes1, [l1 * N + n2 for n2 in range(N) for l1 in range(L)])
        # 4: to node n2 (same local rank) go the blocks of all our local sources
        out = _a2a(step2, inter.send, inter.recv, topo.inter_node_group)
        return Pending(lambda: out)

    def inter_node_rows(self, send_splits, matrix, combine=False) -> int:
        """Step 4: to node n2 (same local rank) the blocks of all this node's sources."""
        lay = Layout.of(self.topo, send_splits, torch.device("cpu"), matrix)
        N, L, n, l, S, g = lay.N, lay.L, lay.n, lay.l, lay.S, lay.g
        return sum(S[g(n, l1)][g(n2, l)] for l1 in range(L) for n2 in range(N) if n2 != n)
