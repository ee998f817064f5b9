"""Cases of the node-deduplicated exchange beyond r = 1 and codec none (importable by spawned
ranks): the float64 parity variants, and the compute-task order one pipelined forward ran."""

from __future__ import annotations

import torch

from moeflow import Topology
from moeflow.schedule.executor import Timeline
from tests.helpers import parity


def pipelined_worker(names: list[str], variants: list[dict]) -> dict:
    """Every case under every variant on 2 nodes x 2, and under ``"order"`` the computing
    tasks (kind, chunk) of one forward at r = 2 with OptSche, as the timeline recorded them."""
    out = parity.variants_worker(names, variants, 2)
    topo = Topology.from_env(local_size=2)
    layer = parity.make_layer("dropless_k2", topo, a2a="node_dedup", pipeline_degree=2,
                              schedule="optsche")
    layer.timeline = Timeline()
    x, _ = parity.make_batch("dropless_k2", topo.rank)
    with torch.no_grad():
        layer(x)
    out["order"] = [(rec.task.kind, rec.task.chunk) for rec in layer.timeline.records
                    if rec.lane == "compute"]
    return out
