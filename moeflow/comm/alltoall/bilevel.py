"""``bilevel``: SMILE's two-stage all-to-all (SMILE section 3.2.3, Fig. 5).

Dispatch: an inter-node all-to-all among the ranks with the same local rank (rank (n, l) sends
to (n', l) everything bound for node n'), then an intra-node all-to-all (to the right local
rank). Combine (``start_combine``): the reverse, intra-node first, then inter-node. Each rank
talks to N-1 + L-1 peers instead of N*L - 1 (O(m + n) launches instead of O(mn)). Results are in
source-rank order like every algorithm, so schedulers and codecs apply unchanged. The split sizes
of the stages are :func:`moeflow.comm.alltoall.phases.bilevel_phases`.
"""

from __future__ import annotations

import torch

from moeflow.comm.alltoall.base import Pending, register_alltoall
from moeflow.comm.alltoall.blocks import take
from moeflow.comm.alltoall.hier2d import Hier2DAllToAll, _a2a
from moeflow.comm.alltoall.hierarchy import Layout, require_nodes
from moeflow.comm.alltoall.phases import bilevel_phases


@register_alltoall("bilevel")
class BiLevelAllToAll(Hier2DAllToAll):
    @classmethod
    def check_topology(cls, topo) -> None:
        require_nodes("bilevel", topo)

    def start(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              matrix: list[list[int]] | None = None) -> Pending:
        """Inter-node stage, then intra-node stage."""
        topo = self.topo
        lay = Layout.of(topo, send_splits, x.device, matrix)
        N, L, n, l, S, g = lay.N, lay.L, lay.n, lay.l, lay.S, lay.g
        # 1: to (n2, l) the blocks for every (n2, l2): contiguous already (destination order)
        inter, intra = bilevel_phases(S, N, L, n, l)
        got1 = _a2a(x, inter.send, inter.recv, topo.inter_node_group)
        # got1: (source node n1, dest local l2) -> regroup by dest local rank
        sizes1 = [S[g(n1, l)][g(n, l2)] for n1 in range(N) for l2 in range(L)]
        step2 = take(got1, sizes1, [n1 * L + l2 for l2 in range(L) for n1 in range(N)])
        # 2: to local rank l2 everything from every source node through us
        got2 = (_a2a(step2, intra.send, intra.recv, topo.intra_node_group) if L > 1
                else step2)
        # got2: (relay local l1, source node n1) -> source-rank order (n1, l1)
        sizes2 = [S[g(n1, l1)][g(n, l)] for l1 in range(L) for n1 in range(N)]
        out = take(got2, sizes2, [l1 * N + n1 for n1 in range(N) for l1 in range(L)])
        return Pending(lambda: out)

    def inter_node_rows(self, send_splits, matrix, combine=False) -> int:
        """Dispatch: stage 1 sends to (n2, l) everything of this rank for node n2; combine
        runs the 2D-hierarchical order (its step 4)."""
        if combine:
            return super().inter_node_rows(send_splits, matrix, combine)
        lay = Layout.of(self.topo, send_splits, torch.device("cpu"), matrix)
        N, L, n, l, S, g = lay.N, lay.L, lay.n, lay.l, lay.S, lay.g
        return sum(S[g(n, l)][g(n2, l2)] for n2 in range(N) if n2 != n for l2 in range(L))

    # Combine: intra-node first, then inter-node among the same local ranks, which is exactly
    # the 2D-hierarchical order.
    start_combine = Hier2DAllToAll.start
