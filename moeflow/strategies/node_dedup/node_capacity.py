"""Capacity per destination node for the node-deduplicated exchange: GShard's capacity slots
(GShard section 2.2) counted on the unit that crosses between nodes, the (token, node) copy of
DeepEP's inter-node dispatch (DeepSeek-V3 section 3.2.2), rather than the (token, expert)
choice.

A rank's ``C`` slots for each of a node's ``En`` experts bound its choices for that node by
``En C``. Its node copies are fewer when the router bounds the distinct nodes of a token below
its k choices (DeepSeek-V3 section 2.1.2's node-limited routing, ``topk_group`` = M; SMILE's
``node_top_k``): a token's k choices land on at most ``p = min(k, N, M)`` nodes, so the copies
are ``p / k`` of the choices. The node capacity is the node's expert slots scaled by that share,
``C_node = ceil(En C p / k)`` (equal to ``En C`` when ``p = k``: then it never binds beyond the
expert capacity). Padded capacity mode (:mod:`moeflow.strategies.node_dedup.padded`) sizes
each node's block of the inter-node hop by it, so its fixed splits carry about the rows the
trimmed mode carries; both modes drop, in token order, the node copies past ``C_node`` (all
of that token's choices on that node), so the two layouts compute the same function. The drops
add to the layer's ``dropped_fraction``, as GShard's do."""

from __future__ import annotations

import torch

from moeflow.comm.alltoall.phases import token_nodes


def nodes_per_token(router, top_k: int, num_nodes: int) -> int:
    """``p = min(k, N, M)``: the most distinct nodes a token's choices reach (M: the router's
    node limit, ``Router.nodes_per_token``; none: N)."""
    bound = router.nodes_per_token(num_nodes)
    return min(top_k, num_nodes, num_nodes if bound is None else int(bound))


def node_capacity(experts_per_node: int, capacity: int, top_k: int, per_token: int) -> int:
    """``C_node = ceil(En C p / k)`` node copies a rank may send to one node (host integers)."""
    return -(-experts_per_node * capacity * per_token // top_k)


def drop_past_node_capacity(ids: torch.Tensor, experts_per_node: int, num_nodes: int,
                            num_experts: int, cap_node: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` (T, k; ``num_experts`` = already dropped) with every choice of a (token, node)
    copy past the node's first ``cap_node`` copies, in token order, set to ``num_experts`` (no
    node), and the number of choices so dropped (0-dim, on the device: no host read)."""
    hit = token_nodes(ids, experts_per_node, num_nodes)               # (T, N)
    over = hit & (torch.cumsum(hit.to(torch.int64), 0) > cap_node)
    over = torch.cat([over, over.new_zeros(over.shape[0], 1)], 1)     # column N: no node
    node = torch.clamp(ids // experts_per_node, max=num_nodes)
    drop = over.gather(1, node)
    return torch.where(drop, num_experts, ids), drop.sum()
