"""Expert placement strategies for ``MoELayer`` (docs/design.md, "Strategies: how experts are
placed"): the interface in ``base.py`` and one file per placement."""

from __future__ import annotations

from moeflow.strategies.base import Call, ExpertStrategy
from moeflow.strategies.expert_parallel import ExpertParallel
from moeflow.strategies.fssdp.strategy import FSSDP
from moeflow.strategies.node_dedup.strategy import NodeDedup
from moeflow.strategies.parm.strategy import Parm

__all__ = ["Call", "ExpertStrategy", "ExpertParallel", "FSSDP", "NodeDedup", "Parm", "select"]


def select(layer) -> ExpertStrategy:
    """The layer's strategy from its config and topology: FSSDP for ``placement="fssdp"``,
    Parm where MP, ESP shards or a paused-MP schedule are in use (with MP, even the baseline
    without ESP: it sends DeepSpeed-MoE's whole capacity buffers), the node-deduplicated
    exchange for ``a2a="node_dedup"`` (which refuses FSSDP and Parm), plain EP otherwise."""
    if layer.cfg.a2a == "node_dedup":
        return NodeDedup(layer)
    if layer.cfg.placement == "fssdp":
        return FSSDP(layer)
    if layer.parm is not None or layer.topo.esp_size > 1 or layer.topo.mp_size > 1:
        return Parm(layer)
    return ExpertParallel(layer)
