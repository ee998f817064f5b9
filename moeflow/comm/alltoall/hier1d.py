"""``hier1d``: the 1D-hierarchical all-to-all of HetuMoE (ScheMoE section 6, "1DH").

1. Every rank of a node sends all its rows to the node leader (local rank 0).
2. The leader regroups them by destination node and the leaders exchange them (one inter-node
   all-to-all among leaders: N-1 large messages per node).
3. Each leader regroups what it received by destination local rank, in source-rank order, and
   scatters it to its local ranks.
Fewest inter-node messages, at the price of the leader relaying everything twice. The split sizes
of the three steps are :func:`moeflow.comm.alltoall.phases.hier1d_phases`.
"""

from __future__ import annotations

import torch

from moeflow.comm.alltoall.base import AllToAll, Pending, register_alltoall
from moeflow.comm.alltoall.blocks import take
from moeflow.comm.alltoall.hier2d import _a2a
from moeflow.comm.alltoall.hierarchy import Layout, require_nodes
from moeflow.comm.alltoall.phases import hier1d_phases


@register_alltoall("hier1d")
class Hier1DAllToAll(AllToAll):
    @classmethod
    def check_topology(cls, topo) -> None:
        require_nodes("hier1d", topo)

    def start(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              matrix: list[list[int]] | None = None) -> Pending:
        topo = self.topo
        lay = Layout.of(topo, send_splits, x.device, matrix)
        N, L, n, l, S, g = lay.N, lay.L, lay.n, lay.l, lay.S, lay.g
        P = N * L
        leader = l == 0
        gather, inter, scatter = hier1d_phases(S, N, L, n, l)
        # 1: gather to the leader (an intra-node all-to-all where only the leader receives)
        if L > 1:
            got = _a2a(x, [x.shape[0]] + [0] * (L - 1), gather.recv, topo.intra_node_group)
        else:
            got = x
        if leader:
            # got: for source l1, blocks for every destination d (ascending)
            sizes = [S[g(n, l1)][d] for l1 in range(L) for d in range(P)]
            order = [l1 * P + g(n2, l2) for n2 in range(N) for l1 in range(L) for l2 in range(L)]
            step2 = take(got, sizes, order)
            got2 = _a2a(step2, inter.send, inter.recv, topo.inter_node_group)
            # got2: for source node n1, source l1, dest local l2; regroup by dest local rank
            sizes2 = [S[g(n1, l1)][g(n, l2)] for n1 in range(N) for l1 in range(L)
                      for l2 in range(L)]
            order2 = [(n1 * L + l1) * L + l2 for l2 in range(L) for n1 in range(N)
                      for l1 in range(L)]
            step3 = take(got2, sizes2, order2)
        else:
            step3 = x.new_empty((0,) + tuple(x.shape[1:]))
        # 3: scatter from the leader
        out = (_a2a(step3, scatter.send, scatter.recv, topo.intra_node_group) if L > 1
               else step3)
        return Pending(lambda: out)

    def inter_node_rows(self, send_splits, matrix, combine=False) -> int:
        """Step 2: only the leader sends, everything of its node bound for other nodes."""
        lay = Layout.of(self.topo, send_splits, torch.device("cpu"), matrix)
        N, L, n, l, S, g = lay.N, lay.L, lay.n, lay.l, lay.S, lay.g
        if l != 0:
            return 0
        return sum(S[g(n, l1)][g(n2, l2)] for l1 in range(L) for n2 in range(N) if n2 != n
                   for l2 in range(L))
