"""Parm: expert-sharding parallelism and its schedules (Parm Section III, Fig. 3).

The baseline schedule (Fig. 3a) with ESP shards, S1 (Fig. 3b: MP-Split before the gate,
EP&ESP-AlltoAll, MP-AllGather after the layer), S2 (Fig. 3c) and the per-call choice between
them (Algorithm 1, ``parallel_schedule="auto"``). The strategy builds the ESP-sharded experts
and, for the paused-MP schedules, its parts (:class:`~.schedules.ParmParts`), which it keeps.
"""

from __future__ import annotations

import torch

from moeflow.strategies.base import Call, ExpertStrategy, register_strategy
from moeflow.strategies.parm import schedules as parm
from moeflow.strategies.parm.baseline import baseline_experts, esp_peers_share_tokens, esp_reduce
from moeflow.strategies.parm.baseline_mp import drops_mp_duplicates, mp_dropped_experts
from moeflow.strategies.parm.checks import check_parm_layer
from moeflow.strategies.parm.measured_choice import confirm
from moeflow.strategies.parm.padding import schedule_trims
from moeflow.strategies.parm.plan_agreement import check_plan_agrees


@register_strategy("parm")
class Parm(ExpertStrategy):
    """ESP-sharded experts; ``parts`` holds S1 / S2 / auto (None for the baseline)."""

    # capacity_padding: trimmed per schedule (trims(); .padding): ted, the pipelined ted, S1,
    # the baseline with whole experts; S2 and the baseline with ESP shards pad
    # the baseline schedule's exchange is the expert-parallel one the tuner times (S1 / S2
    # / auto are refused by the layer: parallel_schedule must be "baseline" to tune)
    counts_inter_node_bytes = False

    def __init__(self, layer) -> None:
        super().__init__(layer)
        self.parts: parm.ParmParts | None = None
        self._trimmed = 0.0               # 1.0 when the last fresh call's plan was trimmed

    @classmethod
    def check_config(cls, cfg, topo) -> None:
        from moeflow.experts.structure import expert_hidden

        check_parm_layer(cfg, topo, expert_hidden(cfg))

    def _expert_reduce(self):
        # this rank's shard of each local expert; the ESP-AllReduce sums the shards
        topo = self.layer.topo
        return esp_reduce(topo) if topo.esp_size > 1 else None

    def build_experts(self):
        experts = super().build_experts()
        self.parts = parm.ParmParts.build(experts, self.layer.cfg, self.layer.topo)
        return experts

    def trims(self, sched: str | None) -> bool:
        """Whether the call's schedule carries a trimmed plan (:func:`.padding.schedule_trims`;
        beyond the Parm paper). ``sched``: the call's, chosen in :meth:`begin` (Algorithm 1's
        choice is the same on every rank)."""
        return schedule_trims(sched, self.layer.topo)

    def begin(self, h: torch.Tensor, call: Call):
        layer = self.layer
        if not call.replay:               # a recomputation reuses the first forward's choice
            call.sched = (None if self.parts is None
                          else self.parts.choose(layer, h.shape[0], call.k, call.factor))
        if call.sched == "s1":            # Fig. 3b: MP-Split before the gate
            h = parm.mp_split_tokens(h, layer.topo)
        return h, layer.experts

    def exchange(self, send, runner, tokens, call):
        layer, plan = self.layer, call.plan
        if not call.replay:               # stats' parm_trimmed; Algorithm 1's kept rows
            self._trimmed = float(plan.host_counts is not None)
            if self.parts is not None:
                self.parts.note_plan(plan)
        if call.sched is not None:        # S1 / S2: EP&ESP-AlltoAll (Section III-C)
            return self.parts.experts(layer.cfg, call.sched, send, plan, runner), None
        topo = layer.topo
        if layer.cfg.parm_check_plan and topo.mp_size > 1 and esp_peers_share_tokens(topo):
            check_plan_agrees(plan, topo)  # one plan split over MP, or shards of the same rows
        if drops_mp_duplicates(topo):     # the baseline, MP and whole experts: 0.8.1's drop
            if runner.shared is not None:
                return mp_dropped_experts(send, plan, runner, topo, tokens)
            return mp_dropped_experts(send, plan, runner, topo), None
        if esp_peers_share_tokens(topo):  # the baseline, ESP inside MP: DeepSpeed-MoE 0.8.1's
            return super().exchange(send, runner, tokens, call)
        # the baseline, ESP peers with other tokens: Eq. 1's ESP-AllGather of the input (Fig.
        # 3a); shared experts run after, not overlapped
        return baseline_experts(send, plan, runner, topo), None

    def stats(self) -> dict[str, float]:
        # whether the last call's plan sent only the kept rows (capacity_padding, .padding),
        # and the ted schedule's forward bytes to other nodes (schedules.ParmParts.stats)
        parts = {} if self.parts is None else self.parts.stats
        return {"parm_trimmed": self._trimmed, **parts}

    def wants_measurement(self) -> bool:
        # parallel_schedule="auto" with parm_auto_measure: once, at the first training call
        auto = None if self.parts is None else self.parts.auto
        return auto is not None and auto.measure_pending(self.layer.cfg)

    def measure_choices(self, x, top_k, capacity_factor, clock, preserved) -> None:
        # Algorithm 1's candidates timed in their predicted order (.measured_choice; beyond
        # the paper); the last call's statistics are put back with the layer's
        trimmed, stats = self._trimmed, dict(self.parts.stats)
        try:
            confirm(self.layer, self.parts.auto, x, top_k, capacity_factor, clock, preserved)
        finally:
            self._trimmed = trimmed
            self.parts.stats.clear()
            self.parts.stats.update(stats)

    def choice_record(self) -> dict:
        # auto: Algorithm 1's own choice, the one the call ran (measured: the calibrated
        # one), the confirmation's medians (ms), wall time (s) and unmeasured candidates
        auto = None if self.parts is None else self.parts.auto
        if auto is None or auto.last is None:
            return {}
        return {"auto_algorithm1": auto.last.schedule, "auto_confirmed": auto.choice,
                "auto_measured_ms": auto.measured, "auto_confirm_s": auto.confirm_s,
                "auto_confirm_cut": list(auto.confirm_cut)}

    def finish(self, y, aux_loss, call):
        if call.sched == "s1":            # MP-AllGather after the layer; MP parts' mean loss
            topo = self.layer.topo
            return parm.mp_gather_tokens(y, call.rows, topo), parm.mp_mean_loss(aux_loss, topo)
        return y, aux_loss
