"""The model-level strategy calls: what the model, the trainer and checkpointing run without
naming a strategy (docs/design.md, "Strategies: how experts are placed").

Each finds the strategies through the model's MoE layers (every module with an
``ExpertStrategy`` as ``strategy``) and calls, once per strategy class present, its class
method with that class's layers, in the order the layers appear in the model.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from moeflow.errors import ConfigError
from moeflow.strategies.base import STRATEGIES, CheckpointEntries, ExpertStrategy, placements


def strategy_layers(model: nn.Module) -> dict[type, list]:
    """Strategy class -> the model's MoE layers using it (model order)."""
    out: dict[type, list] = {}
    for m in model.modules():
        strategy = getattr(m, "strategy", None)
        if isinstance(strategy, ExpertStrategy):
            out.setdefault(type(strategy), []).append(m)
    return out


def setup_model(model: nn.Module) -> None:
    """Once the model is built, before its optimizer (FSSDP: one slot tensor, Algorithm 2)."""
    for cls, layers in strategy_layers(model).items():
        cls.setup_model(model, layers)


def on_step_end(model: nn.Module, optimizer, step: int) -> None:
    """After each optimizer step (``step``: steps done): re-sharding, re-placement."""
    for cls, layers in strategy_layers(model).items():
        cls.on_step_end(model, layers, optimizer, step)


def checkpoint_entries(model: nn.Module, optimizer,
                       optimizer_state: Callable | None) -> list[CheckpointEntries]:
    """What the strategies store in a checkpoint their own way (:class:`CheckpointEntries`)."""
    out = []
    for cls, layers in strategy_layers(model).items():
        entries = cls.checkpoint_entries(model, layers, optimizer, optimizer_state)
        if entries is not None:
            out.append(entries)
    return out


def metrics(model: nn.Module) -> dict:
    """The strategies' training-log metrics of the last step (the same on every rank)."""
    out: dict = {}
    for cls, layers in strategy_layers(model).items():
        out.update(cls.metrics(model, layers))
    return out


def refuse_block_recompute(moe_configs, where: str, setting_first: bool = False) -> None:
    """ConfigError when a MoE layer's strategy cannot run under whole-block activation
    recomputation. ``moe_configs``: (MoE layer index, MoEConfig) pairs; ``where``: what asked
    for the recomputation; ``setting_first``: name the layer's setting first in the message."""
    for i, cfg in moe_configs:
        # placement="auto": refused where any strategy it may choose refuses (none does yet)
        refused = next((r for r in (STRATEGIES[p].refuses_block_recompute(cfg)
                                    for p in placements(cfg)) if r is not None), None)
        if refused is None:
            continue
        setting, why = refused
        if setting_first:
            raise ConfigError(f"{setting} (MoE layer {i}) is invalid with {where}: {why}")
        raise ConfigError(f"{where} is invalid with {setting} (MoE layer {i}): {why}")


__all__ = ["checkpoint_entries", "metrics", "on_step_end", "refuse_block_recompute",
           "setup_model", "strategy_layers"]
