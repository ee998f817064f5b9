"""Ranks of tests/multirank/test_simulate_fssdp.py: a FSSDP layer (4 ranks as 2 nodes x 2) called
twice on the same batch, so that the second call's ``P'`` is Algorithm 1 on the first call's
loads (a window of one iteration); the second call's router ids, executor records (every task's
size: all-to-all bytes, expert rows), spAG / spRS bytes and ``P'`` are returned."""

from __future__ import annotations

import torch

from moeflow import MoEConfig, MoELayer, Topology
from moeflow.schedule.executor import Timeline

TOKENS, D, H, EXPERTS, TOP_K = 24, 8, 16, 8, 2
#: name -> (capacity factor, fssdp options, schedule, r)
CASES = {
    "static-cap": (1.25, {"materialize": "static"}, "sequential", 1),
    "slots-by-load-cap": (1.25, {"materialize": "sparse", "overlap_degree": 3,
                                 "memory_capacity": 1}, "sequential", 1),
    "replicate-dropless": (None, {"materialize": "sparse", "overlap_degree": 1,
                                  "memory_capacity": 2}, "optsche", 2),
    "slots-by-load-rm": (None, {"materialize": "sparse", "overlap_degree": 4,
                                "memory_capacity": 1, "rematerialize": True}, "sequential", 1),
}


def run_case(topo: Topology, name: str) -> dict:
    cap, opts, schedule, r = CASES[name]
    cfg = MoEConfig(d_model=D, d_expert=H, num_experts=EXPERTS, top_k=TOP_K,
                    capacity_factor=cap, schedule=schedule, pipeline_degree=r, seed=3,
                    placement="fssdp", fssdp=opts)
    layer = MoELayer(cfg, topo)
    gen = torch.Generator().manual_seed(100 + topo.rank)
    x = torch.randn(TOKENS, D, generator=gen) * 3
    layer(x.clone().requires_grad_()).square().sum().backward()     # fills the load window
    got = {}

    def keep_ids(_module, _inp, out) -> None:      # returns None: the output is unchanged
        got["ids"] = out.experts

    layer.router.register_forward_hook(keep_ids)
    layer.timeline = Timeline()
    layer(x.clone().requires_grad_()).square().sum().backward()
    stats = layer.experts.stats()
    recs = [(str(rec.task), rec.phase, rec.lane, rec.size) for rec in layer.timeline.records]
    return {"ids": got["ids"].tolist(), "records": recs,
            "holders": [sorted(h) for h in layer.experts.last_placement.holders],
            "spag": int(stats["spag_send_bytes"]), "sprs": int(stats["sprs_send_bytes"]),
            "spag_backward": list(layer.experts.bytes.get("spag_backward", (0, 0)))}


def worker() -> dict:
    topo = Topology.from_env(local_size=2)
    return {name: run_case(topo, name) for name in CASES}
