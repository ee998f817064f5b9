"""Measures how much of the all-to-all a schedule hides on real layer steps: the median
:func:`moeflow.schedule.overlap.overlap_fraction` over forward + backward steps (ScheMoE
section 4), as a function (:func:`measure_overlap`, used by ``moeflow bench layer``) and as a
command (``python -m moeflow.bench.overlap_bench``). Only the ``layer.timeline`` /
``Timeline.records`` interface is used, which every scheduler version of moeflow has: copied
with ``moeflow/schedule/overlap.py`` into an older checkout, it measures that engine the same
way (docs/benchmarks/layer.md does that).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from moeflow.schedule.executor import Timeline
from moeflow.schedule.overlap import overlap_fraction


def measure_overlap(layer, x: torch.Tensor, warmup: int = 1, reps: int = 5) -> float:
    """Median overlap fraction of ``reps`` forward + backward steps of ``layer`` on ``x``."""
    saved, fractions = layer.timeline, []
    try:
        for i in range(warmup + reps):
            layer.timeline = Timeline()
            y = layer(x)
            (y.square().mean() + layer.aux_loss).backward()
            if i >= warmup:
                fractions.append(overlap_fraction(layer.timeline.records))
    finally:
        layer.timeline = saved
        layer.zero_grad(set_to_none=True)
    return statistics.median(fractions)


def _worker(schedules: list[str], r: int, tokens: int, d_model: int, d_expert: int,
            reps: int) -> dict:
    from moeflow import MoEConfig, MoELayer, Topology

    topo = Topology.from_env()
    gen = torch.Generator().manual_seed(1000 + topo.rank)
    x = torch.randn(tokens, d_model, generator=gen, requires_grad=True)
    out = {}
    for schedule in schedules:
        cfg = MoEConfig(d_model=d_model, d_expert=d_expert, num_experts=8, top_k=2,
                        capacity_factor=1.25, seed=1, schedule=schedule,
                        pipeline_degree=1 if schedule == "sequential" else r)
        out[schedule] = measure_overlap(MoELayer(cfg, topo), x, reps=reps)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="local gloo ranks")
    p.add_argument("--schedules", default="pipelined,optsche", help="comma-separated")
    p.add_argument("--pipeline-degree", type=int, default=2, help="r")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=256, help="model width")
    p.add_argument("--d-expert", type=int, default=512, help="expert hidden width")
    p.add_argument("--reps", type=int, default=7, help="timed steps (median)")
    p.add_argument("--cpu-per-rank", default="none", metavar="X",
                   help="hold each rank to X cores with a CPU quota (auto, none; as root)")
    a = p.parse_args(argv)
    from moeflow.launch import launch_local, local_quota

    res = launch_local(_worker, a.nproc, a.schedules.split(","), a.pipeline_degree, a.tokens,
                       a.d_model, a.d_expert, a.reps, timeout_s=600,
                       quota=local_quota(a.cpu_per_rank, a.nproc))
    print(json.dumps({"ranks": res}, indent=2))


if __name__ == "__main__":
    main()
