"""The phases of the hierarchical exchanges: which link each step uses and its split sizes.

Rank (n, l) = node n, local rank l of ``N`` nodes x ``L`` ranks (global rank ``n L + l``); ``S``
is the split matrix ``S[src][dst]`` in rows of one exchange. A :class:`Phase` is one
``all_to_all_single`` of this rank: over the ranks of its node (``"intra"``, group index = local
rank) or over the ranks with its local rank (``"inter"``, group index = node; pipe's: over every
rank, group index = global rank), with the rows it sends to and receives from each member. The
all-to-all algorithms (:mod:`moeflow.comm.alltoall`: ``hier2d``, ``bilevel``, ``hier1d``,
``pipe``) and the node-deduplicated
strategy (:mod:`moeflow.strategies.node_dedup.strategy`) take their split sizes from here, and the step
simulator (:mod:`moeflow.simulate`) models the same phases on per-link lanes, so both follow one
description. Pure host arithmetic (no communication); ``S`` may be nested lists or an array.

* ``hier2d`` (Tutel / DeepSpeed-MoE's 2D-hierarchical all-to-all, ScheMoE Section 6 "2DH"):
  intra-node to the destination's local rank, then inter-node among equal local ranks;
* ``bilevel`` (SMILE Section 3.2.3): inter-node first, then intra-node (its combine is
  ``hier2d``'s order);
* ``hier1d`` (HetuMoE's 1D-hierarchical, ScheMoE Section 6 "1DH"): gather to the node leader,
  inter-node among leaders, scatter from the leader;
* ``node_dedup`` (DeepEP's inter-node dispatch): one row per (token, destination node) across
  nodes, then a fan-out to the experts' ranks inside the node;
* ``pipe`` (ScheMoE Section 5's Pipe-A2A, Fig. 7): the intra-node pairs over the node's ranks
  and the inter-node pairs over the whole world, issued together (concurrent, not in order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INTRA, INTER = "intra", "inter"


@dataclass(frozen=True)
class Phase:
    link: str              # "intra" (the node's ranks) or "inter" (the ranks of equal local rank)
    send: list[int]        # rows to each group member (intra: local rank; inter: node)
    recv: list[int]        # rows from each group member
    members: str = "all"   # "all": every rank of the group runs it; "leaders": local rank 0 only
    world: bool = False    # over every rank (pipe's lane group): members indexed by global rank

    def remote_rows(self, me: int) -> int:
        """Rows sent to other members (other nodes for an inter-node phase)."""
        return sum(r for j, r in enumerate(self.send) if j != me)


def hier2d_phases(S, N: int, L: int, n: int, l: int) -> list[Phase]:
    """Step 2 (intra-node: to local rank l' the blocks for every (n', l')), then step 4
    (inter-node: to node n' the blocks of every local source for (n', l))."""
    g = lambda node, local: node * L + local        # noqa: E731
    send1 = [int(sum(S[g(n, l)][g(n2, l2)] for n2 in range(N))) for l2 in range(L)]
    recv1 = [int(sum(S[g(n, l1)][g(n2, l)] for n2 in range(N))) for l1 in range(L)]
    send2 = [int(sum(S[g(n, l1)][g(n2, l)] for l1 in range(L))) for n2 in range(N)]
    recv2 = [int(sum(S[g(n1, l1)][g(n, l)] for l1 in range(L))) for n1 in range(N)]
    return [Phase(INTRA, send1, recv1), Phase(INTER, send2, recv2)]


def bilevel_phases(S, N: int, L: int, n: int, l: int, combine: bool = False) -> list[Phase]:
    """Dispatch: stage 1 (inter-node: to (n', l) everything for node n'), then stage 2
    (intra-node: to local rank l' what every source node sent through this rank). Combine:
    the 2D-hierarchical order."""
    if combine:
        return hier2d_phases(S, N, L, n, l)
    g = lambda node, local: node * L + local        # noqa: E731
    send1 = [int(sum(S[g(n, l)][g(n2, l2)] for l2 in range(L))) for n2 in range(N)]
    recv1 = [int(sum(S[g(n1, l)][g(n, l2)] for l2 in range(L))) for n1 in range(N)]
    send2 = [int(sum(S[g(n1, l)][g(n, l2)] for n1 in range(N))) for l2 in range(L)]
    recv2 = [int(sum(S[g(n1, l1)][g(n, l)] for n1 in range(N))) for l1 in range(L)]
    return [Phase(INTER, send1, recv1), Phase(INTRA, send2, recv2)]


def hier1d_phases(S, N: int, L: int, n: int, l: int) -> list[Phase]:
    """Step 1 (intra-node: every rank sends all its rows to the leader), step 2 (inter-node
    among the leaders: to node n' everything of this node for n'; ``members="leaders"``), step
    3 (intra-node: the leader scatters to each local rank what it receives)."""
    g = lambda node, local: node * L + local        # noqa: E731
    P = N * L
    leader = l == 0
    rows = int(sum(S[g(n, l)][d] for d in range(P)))
    gather = Phase(INTRA, [rows] + [0] * (L - 1),
                   [int(sum(S[g(n, l1)][d] for d in range(P))) for l1 in range(L)] if leader
                   else [0] * L)
    inter = Phase(INTER,
                  [int(sum(S[g(n, l1)][g(n2, l2)] for l1 in range(L) for l2 in range(L)))
                   for n2 in range(N)] if leader else [0] * N,
                  [int(sum(S[g(n1, l1)][g(n, l2)] for l1 in range(L) for l2 in range(L)))
                   for n1 in range(N)] if leader else [0] * N, members="leaders")
    mine = int(sum(S[s][g(n, l)] for s in range(P)))
    scatter = Phase(INTRA,
                    [int(sum(S[s][g(n, l2)] for s in range(P))) for l2 in range(L)] if leader
                    else [0] * L, [mine] + [0] * (L - 1))
    return [gather, inter, scatter]


def pipe_phases(send_splits, recv_splits, N: int, L: int, n: int) -> list[Phase]:
    """Pipe-A2A (ScheMoE Section 5, Fig. 7) of a rank of node ``n`` that sends
    ``send_splits[d]`` rows to rank d and receives ``recv_splits[s]`` from rank s (its row and
    column of ``S``): the Intra-Stream, an all-to-all over the node's ranks with the blocks of
    its local ranks, and the Inter-Stream, an all-to-all over the whole world (``world=True``,
    the topology's ``lane_group``) with every block of this node's ranks set to zero. The two
    are issued together and waited for together (Eq. 16), not one after the other."""
    local = range(n * L, (n + 1) * L)
    P = N * L
    intra = Phase(INTRA, [int(send_splits[d]) for d in local],
                  [int(recv_splits[s]) for s in local])
    inter = Phase(INTER, [0 if d in local else int(send_splits[d]) for d in range(P)],
                  [0 if s in local else int(recv_splits[s]) for s in range(P)], world=True)
    return [intra, inter]


def token_nodes(ids: torch.Tensor, experts_per_node: int, nodes: int) -> torch.Tensor:
    """``(T, N)`` bool: node m holds one of token t's experts (ids ``>= N x experts_per_node``,
    a dropped choice, reach no node)."""
    hit = torch.zeros(ids.shape[0], nodes + 1, dtype=torch.bool, device=ids.device)
    return hit.scatter_(1, torch.clamp(ids // experts_per_node, max=nodes), True)[:, :nodes]


def crossing_rows(ids: torch.Tensor, experts_per_node: int, nodes: int, node: int
                  ) -> tuple[int, int]:
    """Rows that this rank's tokens (on ``node``) send to other nodes in one exchange, from
    their ``(T, k)`` expert ids: one per (token, choice) on another node, as the per-expert
    exchanges send (``direct``, ``hier2d``, ...), and one per (token, other node), as
    ``node_dedup`` sends (DeepEP's inter-node dispatch). Ids ``>= nodes x experts_per_node``
    (dropped choices) reach no node. A host read (two integers)."""
    owner = torch.clamp(ids // experts_per_node, max=nodes)
    per_choice = int(((owner != node) & (owner < nodes)).sum())
    hit = token_nodes(ids, experts_per_node, nodes)
    per_node = int(hit.sum()) - int(hit[:, node].sum())
    return per_choice, per_node


def kept_choices(expert_ids: torch.Tensor, slot: torch.Tensor, send_rows: int,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Capacity mode: the ``(T, k)`` ids with each dropped choice (``slot >= send_rows`` in an
    untrimmed :func:`~moeflow.dispatch.plan.make_plan`) set to ``num_experts`` (no node), and
    the kept choices per expert."""
    T, k = expert_ids.shape
    kept = (slot < send_rows).view(k, T).t()
    ids = torch.where(kept, expert_ids, num_experts)
    counts = ids.new_zeros(num_experts + 1).index_add_(
        0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))[:num_experts]
    return ids, counts


def node_dedup_phases(NE, C, N: int, L: int, El: int, n: int, l: int) -> list[Phase]:
    """The dispatch's two exchanges: inter-node among equal local ranks, one row per (token,
    destination node) (``C[p][m]``: tokens of rank p with an expert on node m), then the fan-out
    inside the node to the experts' ranks, one row per choice (``NE[p][e]``: choices of rank p
    for expert e; ``El`` experts per rank). The combine runs them backwards."""
    g = lambda node, local: node * L + local        # noqa: E731
    En = El * L
    me = g(n, l)

    def block(src: int, node: int, local: int) -> int:
        return int(sum(NE[src][node * En + local * El + e] for e in range(El)))

    send_a = [int(c) for c in C[me]]
    recv_a = [int(C[g(src, l)][n]) for src in range(N)]
    send_b = [sum(block(g(s, l), n, l2) for s in range(N)) for l2 in range(L)]
    recv_b = [sum(block(g(s, l1), n, l) for s in range(N)) for l1 in range(L)]
    return [Phase(INTER, send_a, recv_a), Phase(INTRA, send_b, recv_b)]
