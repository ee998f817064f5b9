"""Ranks of tests/multirank/test_simulate.py: run the real layer with a Timeline attached and return what
the executor recorded (task, phase, lane, size per record, in record order) with the routing
the layer's router chose, for each (capacity, schedule, r) case."""

from __future__ import annotations

import torch

from moeflow import MoEConfig, MoELayer, Topology
from moeflow.schedule.executor import Timeline

TOKENS, D, H, EXPERTS, TOP_K = 24, 8, 16, 4, 2
CASES = [(cap, s, r) for cap in (1.25, None) for s in ("sequential", "pipelined", "optsche")
         for r in (2, 4)]
# (capacity, schedule, r, codec, codec_backward): the compressed payloads' bytes on the wire
CODEC_CASES = [(1.25, "optsche", 2, "int8", True), (None, "pipelined", 2, "fp16", False)]


def run_case(topo: Topology, cap, schedule: str, r: int, codec: str = "none",
             codec_backward: bool = False) -> dict:
    cfg = MoEConfig(d_model=D, d_expert=H, num_experts=EXPERTS, top_k=TOP_K,
                    capacity_factor=cap, schedule=schedule, pipeline_degree=r, seed=3,
                    codec=codec, codec_backward=codec_backward)
    layer = MoELayer(cfg, topo)
    got = {}

    def keep_ids(_module, _inp, out) -> None:      # returns None: the output is unchanged
        got["ids"] = out.experts

    layer.router.register_forward_hook(keep_ids)
    layer.timeline = Timeline()
    gen = torch.Generator().manual_seed(100 + topo.rank)
    x = torch.randn(TOKENS, D, generator=gen).requires_grad_()
    layer(x).square().sum().backward()
    recs = [(str(rec.task), rec.phase, rec.lane, rec.size) for rec in layer.timeline.records]
    return {"ids": got["ids"].tolist(), "records": recs}


def worker() -> dict:
    topo = Topology.from_env()
    return {case: run_case(topo, *case) for case in CASES + CODEC_CASES}
