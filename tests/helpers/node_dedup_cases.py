"""Cases of the node-deduplicated exchange beyond r = 1 and codec none (importable by spawned
ranks): the float64 parity variants, the compute-task order one pipelined forward ran, and
the backward's task intervals."""

from __future__ import annotations

import time

import torch

from moeflow import Topology
from moeflow.schedule.executor import Timeline
from tests.helpers import parity


def pipelined_worker(names: list[str], variants: list[dict]) -> dict:
    """Every case under every variant on 2 nodes x 2; under ``"order"`` the computing tasks
    (kind, chunk) of one forward at r = 2 with OptSche, as the timeline recorded them."""
    out = parity.variants_worker(names, variants, 2)
    topo = Topology.from_env(local_size=2)
    layer = parity.make_layer("dropless_k2", topo, placement="node_dedup", pipeline_degree=2,
                              schedule="optsche")
    layer.timeline = Timeline()
    x, _ = parity.make_batch("dropless_k2", topo.rank)
    with torch.no_grad():
        layer(x)
    out["order"] = [(rec.task.kind, rec.task.chunk) for rec in layer.timeline.records
                    if rec.lane == "compute"]
    return out


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the experts' backward made long next to a hop."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(SLOW_EXPERTS_S)
        return g


SLOW_EXPERTS_S = 0.05


def backward_overlap_worker(schedules: list[str]) -> dict:
    """Per scheduler: the backward's task records ``(kind, chunk, lane, start, end)`` of one
    forward + backward at r = 2 (dropless_k2 on 2 nodes x 2), the experts' backward slowed to
    SLOW_EXPERTS_S per chunk so that a hop in flight beside it shows in the intervals."""
    topo = Topology.from_env(local_size=2)
    out: dict = {}
    for schedule in schedules:
        layer = parity.make_layer("dropless_k2", topo, placement="node_dedup", pipeline_degree=2,
                                  schedule=schedule)
        forward = layer.experts.forward
        layer.experts.forward = lambda *a, **k: _SlowBackward.apply(forward(*a, **k))
        layer.timeline = Timeline()
        x, g = parity.make_batch("dropless_k2", topo.rank)
        parity.local_loss(layer(x.requires_grad_()), g, layer).backward()
        out[schedule] = [(rec.task.kind, rec.task.chunk, rec.lane, rec.start, rec.end)
                         for rec in layer.timeline.records if rec.phase == "backward"]
        layer.lane.close()
    return out


def frozen_worker(modes: list[str]) -> dict:
    """One dropless_k2 step at r = 2 with OptSche on 2 nodes x 2 per mode: "none" (``direct``,
    nothing frozen: the reference), "frozen_router" (node_dedup; the router frozen and the
    input without grad: the send buffer needs no gradient) and "frozen_experts" (node_dedup;
    the experts frozen). Per mode: the gradients present, the input gradient, the output."""
    topo = Topology.from_env(local_size=2)
    out: dict = {}
    for mode in modes:
        layer = parity.make_layer("dropless_k2", topo, pipeline_degree=2, schedule="optsche",
                                  placement="ep" if mode == "none" else "node_dedup")
        x, g = parity.make_batch("dropless_k2", topo.rank)
        if mode != "frozen_router":
            x.requires_grad_()
        frozen = {"frozen_router": layer.router, "frozen_experts": layer.experts}.get(mode)
        for p in frozen.parameters() if frozen is not None else ():
            p.requires_grad_(False)
        y = layer(x)
        (y * g).sum().backward()
        out[mode] = ({n: p.grad for n, p in layer.named_parameters() if p.grad is not None},
                     x.grad, y.detach())
        layer.lane.close()
    return out


def codec_worker(names: list[str], codecs: list[str], a2as: tuple = ("node_dedup",)) -> dict:
    """Every case with every codec (gradients encoded too) and all-to-all, at r = 2 with
    OptSche, on 2 nodes x 2 (with each result, the step's inter-node bytes:
    ``parity.run_rank``)."""
    topo = Topology.from_env(local_size=2)
    return {(name, codec, a2a): parity.run_rank(name, topo, codec=codec, codec_backward=True,
                                                pipeline_degree=2, schedule="optsche",
                                                **({"placement": a2a} if a2a == "node_dedup"
                                                   else {"a2a": a2a}))
            for name in names for codec in codecs for a2a in a2as}


def relative_errors(got: dict, ref: dict, rank: int, world: int) -> dict[str, float]:
    """Max |got - ref| / max |ref| of the output, the input gradient and the parameters after
    the step (the rank's expert shard), as ``parity.assert_rank_matches`` compares them."""
    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max()) if b.numel() else 0.0

    lo, n = got["first_expert"], got["num_local"]
    params = [rel(v, ref["params"][p][lo:lo + n] if p.startswith("experts.")
                  else ref["params"][p]) for p, v in got["params"].items()]
    return {"y": rel(got["y"], ref["y"][rank]),
            "x_grad": rel(got["x_grad"], world * ref["x_grad"][rank]),
            "params": max(params)}


def tuner_worker(name: str) -> dict:
    """On 2 nodes x 2: ``placement="node_dedup"`` with schedule and degree tuned (the
    profiler and the chooser on it), then the parity step."""
    topo = Topology.from_env(local_size=2)
    seen: dict = {}

    def tune_schedule(layer, x):
        layer.tune(x)
        seen["choice"] = (layer.cfg.a2a, layer.cfg.schedule, layer.cfg.pipeline_degree,
                          layer.strategy.name)

    res = parity.run_rank(name, topo, tune_schedule, placement="node_dedup", schedule="auto",
                          pipeline_degree="auto", autotune_budget_s=None)
    return dict(res, **seen)
