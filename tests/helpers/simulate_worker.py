"""Ranks of tests/multirank/test_simulate.py: run the real layer with a Timeline attached and return what
the executor recorded (task, phase, lane, size per record, in record order) with the routing
the layer's router chose, for each (capacity, schedule, r) case; BigMac's cases also return the
bytes the layer handed to the all-to-all (the ``counting`` algorithm, moeflow.bench.a2a_count);
node_dedup's cases (2 emulated nodes of one rank) also the layer's inter-node bytes."""

from __future__ import annotations

import torch

from moeflow import MoEConfig, MoELayer, Topology
from moeflow.cases.layer_grid import exchange_fields
from moeflow.schedule.executor import Timeline

TOKENS, D, H, EXPERTS, TOP_K = 24, 8, 16, 4, 2
CASES = [(cap, s, r) for cap in (1.25, None) for s in ("sequential", "pipelined", "optsche")
         for r in (2, 4)]
# (capacity, schedule, r, codec, codec_backward): the compressed payloads' bytes on the wire
CODEC_CASES = [(1.25, "optsche", 2, "int8", True), (None, "pipelined", 2, "fp16", False)]
# BigMac's DCCA (r = 0.25: the all-to-alls at 2 of D = 8 columns, experts 2 -> 64 -> 2), and
# the same layer as plain EP (fine_grained: D columns) for the byte ratio
BIGMAC_CASES = [(cap, s, r, st) for st in ("bigmac", "fine_grained")
                for cap, s, r in ((None, "optsche", 2), (1.25, "pipelined", 2))]
# node_dedup on the 2 ranks as 2 nodes x 1 (capacity, schedule, r, codec, codec_backward): its
# chunks' hops as lane tasks in OptSche's order, forward and scheduled backward
DEDUP_CASES = [(None, "optsche", 2, "none", False)]
DEDUP_SLOW_CASES = [(1.25, "optsche", 2, "int8", True)]


def run_case(topo: Topology, cap, schedule: str, r: int, codec: str = "none",
             codec_backward: bool = False, a2a: str = "direct") -> dict:
    cfg = MoEConfig(d_model=D, d_expert=H, num_experts=EXPERTS, top_k=TOP_K,
                    capacity_factor=cap, schedule=schedule, pipeline_degree=r, seed=3,
                    codec=codec, codec_backward=codec_backward, **exchange_fields(a2a))
    layer = MoELayer(cfg, topo)
    got = {}

    def keep_ids(_module, _inp, out) -> None:      # returns None: the output is unchanged
        got["ids"] = out.experts

    layer.router.register_forward_hook(keep_ids)
    recs = _step_records(layer, topo)
    return {"ids": got["ids"].tolist(), "records": recs,
            "inter_node_bytes": int(layer.stats["inter_node_bytes"])}


def _step_records(layer: MoELayer, topo: Topology) -> list:
    """One forward + backward of ``layer`` on this rank's seeded tokens, with a Timeline
    attached: each task's (name, pass, lane, recorded size)."""
    layer.timeline = Timeline()
    gen = torch.Generator().manual_seed(100 + topo.rank)
    x = torch.randn(TOKENS, D, generator=gen).requires_grad_()
    layer(x).square().sum().backward()
    return [(str(rec.task), rec.phase, rec.lane, rec.size) for rec in layer.timeline.records]


def run_structure(topo: Topology, cap, schedule: str, r: int, structure: str) -> dict:
    """One structure's layer with the ``counting`` all-to-all (a direct one that counts the
    bytes handed to it) and a Timeline attached."""
    from moeflow.bench import a2a_count  # noqa: F401  (registers "counting")

    cfg = MoEConfig(d_model=D, d_expert=H, num_experts=EXPERTS, top_k=TOP_K,
                    capacity_factor=cap, schedule=schedule, pipeline_degree=r, seed=3,
                    structure=structure, a2a="counting")
    layer = MoELayer(cfg, topo)
    got = {}
    layer.router.register_forward_hook(lambda _m, _i, out: got.update(ids=out.experts))
    recs = _step_records(layer, topo)
    return {"ids": got["ids"].tolist(), "records": recs,
            "payload_bytes": int(layer.algo.payload_bytes)}


def worker() -> dict:
    topo = Topology.from_env()
    out = {case: run_case(topo, *case) for case in CASES + CODEC_CASES}
    out.update({case: run_structure(topo, *case) for case in BIGMAC_CASES})
    nodes = Topology.from_env(local_size=1)         # 2 emulated nodes of one rank
    out.update({("node_dedup", *case): run_case(nodes, *case, a2a="node_dedup")
                for case in DEDUP_CASES})
    return out


def dedup_worker() -> dict:
    """The slow node_dedup cases (2 nodes x 1)."""
    nodes = Topology.from_env(local_size=1)
    return {("node_dedup", *case): run_case(nodes, *case, a2a="node_dedup")
            for case in DEDUP_SLOW_CASES}
