"""Choosing codec, all-to-all algorithm, pipelining degree and scheduler from profiled fits.

For each (codec, algorithm) the layer is profiled at a few pipelining degrees (``profiler``);
the fitted task models then predict every task of every candidate (r, scheduler), and the
two-lane model (``simulate``, ScheMoE section 4.1) predicts forward + backward time of the
exchange + experts block; the rest of the layer (route, permute, combine) is added as the
measured r = 1 step time minus the block's r = 1 prediction. The best
prediction wins; ``explain`` prints every candidate's prediction, so the choice can be checked,
and callers print the measured time beside it. On CUDA the profiler's step times are device
times (CUDA events); the ranks agree on the predictions through a host-side all-reduce that
works on gloo and on ``cpu:gloo,cuda:nccl`` groups (:func:`moeflow.devices.host_all_reduce`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.schedule import SCHEDULERS
from moeflow.schedule.profiler import LinearModel, fit_models
from moeflow.schedule.two_lane_model import simulate
from moeflow.schedule.tasks import Task


@dataclass
class Candidate:
    codec: str
    a2a: str
    schedule: str
    pipeline_degree: int
    predicted_s: float


def predict(models: dict[str, LinearModel], sizes: dict[tuple[str, str], float], r: int,
            schedule: str) -> float:
    sched = SCHEDULERS[schedule]()
    total = 0.0
    for phase in ("forward", "backward"):
        if (phase, "E") not in sizes:
            # a pass that runs no scheduled tasks: its time stays in the measured rest of
            # the step
            continue

        def times(t: Task, phase=phase) -> float:
            key = f"E_{phase}" if t.kind == "E" else t.kind[0]
            return models[key].predict(sizes[(phase, t.kind)] / r)
        total += simulate(sched.order(r), times, overlap=sched.overlap)[0]
    return total


def choose(make_layer, x: torch.Tensor, codecs: list[str], algos: list[str],
           degrees: list[int], schedules: list[str], reps: int = 3
           ) -> tuple[Candidate, list[Candidate], dict]:
    """``make_layer(codec, a2a) -> MoELayer``; returns (best, candidates by prediction, fits).

    Profiles each (codec, a2a) at r = 1 (whose task sizes are those of a whole pass) and at the
    other candidate degrees (so the fits span small and large tasks).
    """
    from moeflow.schedule.profiler import profile

    import statistics

    candidates, fits = [], {}
    for codec in dict.fromkeys(codecs):
        for a2a in dict.fromkeys(algos):
            layer = make_layer(codec, a2a)
            whole, steps = profile(layer, x, [1], reps)
            more, _ = profile(layer, x, sorted(set(degrees) - {1}), reps)
            models = fit_models(whole + more)
            sizes = {(rec.phase, rec.task.kind): float(rec.size) for rec in whole}
            rest = max(0.0, statistics.median(steps) - predict(models, sizes, 1, "sequential"))
            fits[(codec, a2a)] = models
            for r in degrees:
                for s in schedules:
                    candidates.append(Candidate(codec, a2a, s, r,
                                                rest + predict(models, sizes, r, s)))
    _agree(candidates)
    candidates.sort(key=lambda c: c.predicted_s)
    return candidates[0], candidates, fits


def _agree(candidates: list[Candidate]) -> None:
    """Average predictions over ranks so that every rank makes the same choice (each rank
    profiled its own tasks; divergent choices would mismatch collectives)."""
    from moeflow.devices import host_all_reduce

    if not candidates:
        return
    for c, v in zip(candidates, host_all_reduce([c.predicted_s for c in candidates], "mean")):
        c.predicted_s = v


def explain(candidates: list[Candidate], top: int = 10) -> str:
    lines = [f"{'codec':<8} {'a2a':<9} {'schedule':<11} {'r':>2} {'predicted ms':>13}"]
    for c in candidates[:top]:
        lines.append(f"{c.codec:<8} {c.a2a:<9} {c.schedule:<11} {c.pipeline_degree:>2} "
                     f"{c.predicted_s * 1e3:>13.2f}")
    return "\n".join(lines)
