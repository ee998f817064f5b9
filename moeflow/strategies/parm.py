"""Parm: expert-sharding parallelism and its schedules (Parm Section III, Fig. 3).

The baseline schedule (Fig. 3a) with ESP shards, S1 (Fig. 3b: MP-Split before the gate,
EP&ESP-AlltoAll, MP-AllGather after the layer), S2 (Fig. 3c) and the per-call choice between
them (Algorithm 1, ``parallel_schedule="auto"``). The work is done by
``moeflow/parallel/parm/``; this file only plugs it into the layer.
"""

from __future__ import annotations

import torch

from moeflow.parallel.parm import schedules as parm
from moeflow.parallel.parm.baseline import baseline_experts
from moeflow.strategies.base import Call, ExpertStrategy


class Parm(ExpertStrategy):
    """ESP-sharded experts; ``layer.parm`` holds S1 / S2 / auto (None for the baseline)."""

    name = "parm"
    trims_padding = False
    counts_inter_node_bytes = False

    def prepare(self, h: torch.Tensor, k: int, factor: float | None):
        layer = self.layer
        sched = None if layer.parm is None else layer.parm.choose(layer, h.shape[0], k, factor)
        call = Call(sched, h.shape[0])
        if sched == "s1":                 # Fig. 3b: MP-Split before the gate
            h = parm.mp_split_tokens(h, layer.topo)
        return h, call

    def exchange(self, send, plan, runner, tokens, call):
        layer = self.layer
        if call.sched is not None:        # S1 / S2: EP&ESP-AlltoAll (Section III-C)
            return layer.parm.experts(layer.cfg, call.sched, send, plan, runner), None
        # the baseline schedule (Fig. 3a) with shards; shared experts run after, not overlapped
        return baseline_experts(send, plan, runner, layer.topo), None

    def finish(self, y, aux_loss, call):
        if call.sched == "s1":            # MP-AllGather after the layer; MP parts' mean loss
            topo = self.layer.topo
            return parm.mp_gather_tokens(y, call.rows, topo), parm.mp_mean_loss(aux_loss, topo)
        return y, aux_loss
