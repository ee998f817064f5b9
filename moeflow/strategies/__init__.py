"""Expert placement strategies for ``MoELayer`` (docs/design.md, "Strategies: how experts are
placed"): the interface and registry in ``base.py``, one package (or module) per strategy,
registered under the name ``MoEConfig.placement`` selects, and the model-level calls of the
model, the trainer and checkpointing in ``model_hooks.py``. Importing this package registers
the built-in strategies."""

from __future__ import annotations

from moeflow.config import AUTO, AUTO_PLACEMENTS
from moeflow.strategies.base import (STRATEGIES, Call, CheckpointEntries, ExpertStrategy,
                                     placements, register_strategy)
# Importing registers each strategy under its name.
from moeflow.strategies.expert_parallel import ExpertParallel
from moeflow.strategies.fssdp.strategy import FSSDP
from moeflow.strategies.node_dedup.strategy import NodeDedup
from moeflow.strategies.parm.strategy import Parm

__all__ = ["STRATEGIES", "Call", "CheckpointEntries", "ExpertStrategy", "ExpertParallel",
           "FSSDP", "NodeDedup", "Parm", "placements", "register_strategy", "strategy_for"]


def strategy_for(cfg, topo) -> type[ExpertStrategy]:
    """The strategy class ``MoEConfig.placement`` names in the registry. One name is completed
    by the topology: ``"ep"`` on Parm's layouts (model parallelism or ESP shards, Parm
    Section III) is Parm's baseline schedule (Fig. 3a), which is expert parallelism on that
    layout; ``placement="parm"`` names it directly. ``"auto"`` starts as ``"ep"`` (the first
    of ``AUTO_PLACEMENTS``) until the auto-tuner measures the others (moeflow/autotune/)."""
    placement = AUTO_PLACEMENTS[0] if cfg.placement == AUTO else cfg.placement
    if placement == "ep" and (topo.mp_size > 1 or topo.esp_size > 1):
        return Parm
    return STRATEGIES[placement]
