"""How MoELayer runs Parm's schedules S1, S2, ``ted`` (also in pipelined chunks) and ``auto``
(the baseline is in :mod:`.baseline`).

:class:`ParmParts` holds what the EP&ESP exchange needs (the local experts as shard partials,
the all-to-all algorithm over the EP&ESP block) and, for ``parallel_schedule="auto"``, the
Algorithm 1 chooser. The layer asks :meth:`ParmParts.choose` for the call's schedule, applies
S1's MP-Split / MP-AllGather around the layer itself (:mod:`.s1`) and hands the exchange to
:meth:`ParmParts.experts`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moeflow.comm.alltoall import ALLTOALLS
from moeflow.config import MoEConfig
from moeflow.dispatch.plan import DispatchPlan
from moeflow.strategies.parm.algorithm1 import AutoSchedule
from moeflow.strategies.parm.checks import check_saa, check_ted, uses_parm
from moeflow.strategies.parm.padding import TRIMMING_SCHEDULES
from moeflow.strategies.parm.plan_agreement import check_plan_agrees
from moeflow.strategies.parm.ep_esp import ShardPartials, ep_esp_experts, ep_esp_view
from moeflow.strategies.parm.s1 import mp_gather_tokens, mp_mean_loss, mp_split_tokens
from moeflow.strategies.parm.s2 import s2_experts
from moeflow.strategies.parm.ted import ted_experts
from moeflow.strategies.parm.ted_pipelined import pipelined_chunks
from moeflow.schedule.pipeline import ScheduledExperts
from moeflow.topology import Topology

__all__ = ["ParmParts", "mp_gather_tokens", "mp_mean_loss", "mp_split_tokens"]


@dataclass(eq=False)
class ParmParts:
    topo: Topology
    partials: ShardPartials        # not a submodule of the layer: it wraps layer.experts
    algo: object                   # the all-to-all algorithm over the EP&ESP block
    auto: AutoSchedule | None
    stats: dict = dataclasses.field(default_factory=dict)   # the last call's (ted: bytes)

    @classmethod
    def build(cls, experts, cfg: MoEConfig, topo: Topology) -> "ParmParts | None":
        """None when the layer runs no paused-MP schedule (baseline, or no MP / ESP);
        ``experts``: the layer's ESP-sharded experts."""
        if cfg.parallel_schedule == "baseline" or not uses_parm(topo):
            return None
        auto = AutoSchedule(topo) if cfg.parallel_schedule == "auto" else None
        return cls(topo, ShardPartials(experts), ALLTOALLS[cfg.a2a](ep_esp_view(topo)),
                   auto)

    def choose(self, layer, tokens: int, top_k: int, factor: float | None) -> str:
        """This call's schedule: the config's, or Algorithm 1's (the same on every rank); its
        byte terms take the kept rows for the candidates that trim in this call
        (``layer.trims_capacity``, :mod:`.padding`; beyond the paper)."""
        cfg = layer.cfg
        if self.auto is None:
            return cfg.parallel_schedule
        device = next(layer.parameters()).device     # the fits time this device's buffers
        trimmed = frozenset() if factor is None else frozenset(
            s for s in TRIMMING_SCHEDULES if layer.trims_capacity(s, device))
        return self.auto.choose(cfg, tokens, top_k, factor, device, trimmed)

    def note_plan(self, plan: DispatchPlan) -> None:
        """A fresh call's plan: for ``auto``, a trimmed plan's kept rows
        (:meth:`.algorithm1.AutoSchedule.note_kept`; beyond the paper)."""
        self.stats.clear()
        if plan.host_counts is not None and self.auto is not None:
            self.auto.note_kept(plan.send_rows, plan.num_tokens * plan.top_k)

    def experts(self, cfg: MoEConfig, sched: str, send: torch.Tensor, plan: DispatchPlan,
                runner: ScheduledExperts) -> torch.Tensor:
        """The exchange + experts block of S1 or S2 (differentiable), with the layer's codecs,
        scheduler, chunks and lane on the EP&ESP payloads (S2 with SAA: none of them)."""
        ep_esp = ScheduledExperts(self.partials, self.algo, runner.codec, runner.backward_codec,
                                  runner.scheduler, runner.r, runner.lane, runner.timeline,
                                  runner.nonfinite, recompute=runner.recompute,
                                  can_recompute=runner.can_recompute)
        if sched == "s1":
            return ep_esp_experts(send, plan, ep_esp, self.topo)
        chunks = pipelined_chunks(sched)             # auto's pipelined ted: its own chunks
        if sched == "ted" or chunks is not None:     # one plan split over MP, as S2
            if chunks is None:                       # the config's: pipeline_degree, schedule
                check_ted(cfg, runner.r)             # (the degree may have changed since)
                chunks, overlap = runner.r, cfg.schedule == "pipelined"
            else:
                overlap = True
            if cfg.parm_check_plan:
                check_plan_agrees(plan, self.topo)
            return ted_experts(send, plan, self.partials, self.topo, self.stats, chunks,
                               overlap)
        check_saa(cfg, runner.r)         # the degree may have changed since construction
        if cfg.parm_check_plan:          # S2 splits one plan over the MP group
            check_plan_agrees(plan, self.topo)
        return s2_experts(send, plan, ep_esp, self.topo, saa=cfg.parm_saa)
