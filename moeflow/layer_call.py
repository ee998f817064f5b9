"""One ``MoELayer`` forward's decisions, fresh or replayed.

Under ``torch.utils.checkpoint`` a MoE layer's recomputation must not decide anything again
(Megatron-core's MoE recompute; HECATE Section 3.2, one ``P'`` per step): it routes with the
first forward's expert choices, reuses its plan and counts, its strategy's choices and the
exchange settings the tuner had then, and adds nothing to the reported statistics. A
:class:`LayerCall` holds either the decisions made now or those of the first forward
(:mod:`moeflow.plan_record` keeps them between the two), so that the layer's forward reads
the same either way.
"""

from __future__ import annotations

import dataclasses

import torch

from moeflow import plan_record
from moeflow.strategies.base import Call


class LayerCall:
    """``call``: the strategy's :class:`~moeflow.strategies.base.Call`; ``record``: the first
    forward's :class:`~moeflow.plan_record.PlanRecord` in a recomputation, else None;
    ``where``: the checkpoint region (None outside one)."""

    def __init__(self, call: Call, where, record: plan_record.PlanRecord | None = None):
        self.call, self.where, self.record = call, where, record

    @classmethod
    def fresh(cls, rows: int, k: int, factor: float | None, where) -> "LayerCall":
        return cls(Call(k, factor, rows, checkpointed=where is not None), where)

    @classmethod
    def replayed(cls, record: plan_record.PlanRecord, where) -> "LayerCall":
        # a copy: a graph backwarded twice replays the record twice
        return cls(dataclasses.replace(record.call, replay=True), where, record)

    @property
    def replay(self) -> bool:
        return self.record is not None

    def route_options(self, layer) -> dict:
        """The router's per-call arguments: the call's top-k where it is not the config's,
        and in a replay the recorded choices (the gates are recomputed at them)."""
        options = {} if self.call.k == layer.cfg.top_k else {"top_k": self.call.k}
        if self.replay and layer.router.replays_choices:
            options["chosen"] = self.record.experts
        return options

    def counters(self, layer, like: torch.Tensor):
        """(non-finite payload count, inter-node bytes): new ones, or the first forward's (the
        backward's counts land in the reported ones)."""
        if self.replay:
            return self.record.nonfinite, self.record.inter_bytes
        nonfinite = (None if layer.codec.represents_nonfinite
                     and layer.backward_codec.represents_nonfinite
                     else like.new_zeros((), dtype=torch.long))
        # host counter (no device sync): forward's exchanges add here, backward's in place
        inter_bytes = (torch.zeros((), dtype=torch.long)
                       if layer.strategy.counts_inter_node_bytes else None)
        return nonfinite, inter_bytes

    def keep(self, layer, routing, runner) -> None:
        """A checkpoint's first forward: keep its decisions for the recomputation (before
        the exchange, which sets the plan's counts that the recomputation reuses)."""
        if self.replay or self.where is None or self.where[0] != "forward":
            return
        plan_record.save(self.where, layer, plan_record.PlanRecord(
            routing.experts.detach(), self.call, layer.exchange_settings(),
            runner.nonfinite, runner.inter_node_bytes))
