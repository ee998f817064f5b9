"""``node_dedup``: each token crosses to a node once (DeepEP's inter-node dispatch,
Megatron-core's flex dispatcher; the hierarchical exchange of SMILE section 3.2.3 made
token-aware).

The name selects the node-deduplicated dispatch and combine of the MoE layer
(:mod:`moeflow.strategies.node_dedup.strategy`): a token goes once to every node that holds one of its
experts, with its expert ids and gate weights, to the rank with the same local rank there,
which fans it out to the experts' ranks over the intra-node links; the way back sums the
gated expert outputs inside the node first, so one partial sum per (token, node) crosses back.
Inter-node bytes per dispatch and per combine are (tokens x distinct destination nodes), not
(tokens x k).

As a plain row exchange (rows that are not known to be copies of one token: the interface of
:class:`~moeflow.comm.alltoall.base.AllToAll`) it is the bi-level exchange, inter-node stage
first; deduplication needs the routing, which only the layer's strategy has.
"""

from __future__ import annotations

from moeflow.comm.alltoall.base import register_alltoall
from moeflow.comm.alltoall.bilevel import BiLevelAllToAll
from moeflow.comm.alltoall.hierarchy import require_nodes


@register_alltoall("node_dedup")
class NodeDedupAllToAll(BiLevelAllToAll):
    # screened by the auto-tuner where its strategy runs with the config
    # (moeflow.autotune.tuner.candidate_algorithms); choosing it swaps the layer's strategy
    # too (moeflow.autotune.settings.apply)

    @classmethod
    def check_topology(cls, topo) -> None:
        require_nodes("node_dedup", topo)
