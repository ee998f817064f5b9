"""Parm: expert-sharding parallelism and its schedules (Parm Section III, Fig. 3).

The baseline schedule (Fig. 3a) with ESP shards, S1 (Fig. 3b: MP-Split before the gate,
EP&ESP-AlltoAll, MP-AllGather after the layer), S2 (Fig. 3c) and the per-call choice between
them (Algorithm 1, ``parallel_schedule="auto"``). The work is done by
``moeflow/strategies/parm/``; this file only plugs it into the layer.
"""

from __future__ import annotations

import torch

from moeflow.strategies.parm import schedules as parm
from moeflow.strategies.parm.baseline import baseline_experts, esp_peers_share_tokens
from moeflow.strategies.parm.plan_agreement import check_plan_agrees
from moeflow.strategies.base import Call, ExpertStrategy


class Parm(ExpertStrategy):
    """ESP-sharded experts; ``layer.parm`` holds S1 / S2 / auto (None for the baseline)."""

    name = "parm"
    trims_padding = False
    counts_inter_node_bytes = False

    def prepare(self, h: torch.Tensor, k: int, factor: float | None, call: Call | None = None):
        layer = self.layer
        if call is None:                  # a recomputation reuses the first forward's choice
            sched = (None if layer.parm is None
                     else layer.parm.choose(layer, h.shape[0], k, factor))
            call = Call(sched, h.shape[0])
        sched = call.sched
        if sched == "s1":                 # Fig. 3b: MP-Split before the gate
            h = parm.mp_split_tokens(h, layer.topo)
        return h, call

    def exchange(self, send, plan, runner, tokens, call):
        layer = self.layer
        if call.sched is not None:        # S1 / S2: EP&ESP-AlltoAll (Section III-C)
            return layer.parm.experts(layer.cfg, call.sched, send, plan, runner), None
        topo = layer.topo
        if esp_peers_share_tokens(topo):  # the baseline, ESP inside MP: DeepSpeed-MoE 0.8.1's
            if layer.cfg.parm_check_plan and topo.mp_size > 1 and topo.esp_size > 1:
                check_plan_agrees(plan, topo)    # the ESP peers' shards sum the same rows
            return super().exchange(send, plan, runner, tokens, call)
        # the baseline, ESP peers with other tokens: Eq. 1's ESP-AllGather of the input (Fig.
        # 3a); shared experts run after, not overlapped
        return baseline_experts(send, plan, runner, topo), None

    def finish(self, y, aux_loss, call):
        if call.sched == "s1":            # MP-AllGather after the layer; MP parts' mean loss
            topo = self.layer.topo
            return parm.mp_gather_tokens(y, call.rows, topo), parm.mp_mean_loss(aux_loss, topo)
        return y, aux_loss
