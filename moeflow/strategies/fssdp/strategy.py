"""HECATE's fully sharded sparse data parallelism (HECATE Sections 3-4).

Experts are stored sharded over all ranks (``moeflow/strategies/fssdp/layer_experts.FSSDPExperts``):
``experts()`` finishes the sparse AllGather of this iteration's experts (Section 3.2; started
early by ``prefetch``, Fig. 1c), ``plan`` dispatches to the ranks holding a copy (Section 4.4),
and ``end`` frees the held copies (HECATE-RM, Section 4.3) where the backward re-gathers them.
With ``MoEConfig.recompute="moe_act"`` the forward keeps the experts' input rows and the held
copy's weights (views of the stacked tensor, the storage HECATE-RM frees and refills), and the
backward's expert task recomputes the experts with them: no collective is added.
Under activation checkpointing the recomputation re-gathers the recorded ``P'`` and reuses the
first forward's plan (:mod:`moeflow.plan_record`): one ``P'``, one count exchange and one load
window entry per step.
"""

from __future__ import annotations

import torch

from moeflow import plan_record
from moeflow.strategies.base import ExpertStrategy


class FSSDP(ExpertStrategy):
    """Owner-only expert storage, gathered per iteration; ``layer.experts`` is an
    ``FSSDPExperts``. Capacity padding is laid out by its plan, never trimmed."""

    name = "fssdp"
    trims_padding = False
    counts_inter_node_bytes = False

    def __init__(self, layer) -> None:
        super().__init__(layer)
        self._replaying = False

    def experts(self):
        return self.layer.experts.begin(self.layer.lane)     # spAG(P, P') done

    def plan(self, expert_ids, cap, device, call):
        # a checkpoint's first forward is a training forward even without grad (reentrant)
        training = torch.is_grad_enabled() or plan_record.region() is not None
        return self.layer.experts.plan(expert_ids, cap, training)

    def record_state(self):
        return self.layer.experts.last_placement       # P', after any calibration

    def replay_experts(self, state):
        self._replaying = True
        return self.layer.experts.replay_begin(state)

    def replay_plan(self, plan, state):
        return self.layer.experts.replay_plan(plan, state)

    def end(self, back, checkpointed: bool = False):
        replaying, self._replaying = self._replaying, False
        return self.layer.experts.end(back, checkpointed, timed=not replaying)

    def prefetch(self, lane) -> None:
        if self.layer.cfg.fssdp.early_gather:
            self.layer.experts.prefetch(lane)

    def regather_on_grad(self, t, lane) -> None:
        self.layer.experts.regather_on_grad(t, lane)      # no-op unless overlap_regather

    def stats(self) -> dict[str, float]:
        return self.layer.experts.stats()
