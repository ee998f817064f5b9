"""The task profiler (ScheMoE section 3.2): time every task of a layer and fit per-task models.

Communication tasks get the alpha-beta model ``t = alpha + beta * bytes``; compress, decompress
and expert tasks a per-element model ``t = a + b * elements`` (forward and backward experts
separately). Fits are least squares (numpy) over the records of several runs at different
pipelining degrees, so the sizes vary. Whole forward + backward steps are timed on the input's
device (:class:`moeflow.devices.Stopwatch`: CUDA events on GPUs, where the host clock would
time kernel launches rather than the work; the host clock on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeflow.devices import Stopwatch, synchronize
from moeflow.measure.timing import layer_step
from moeflow.schedule.executor import TaskRecord, Timeline


@dataclass
class LinearModel:
    """``t = a + b * size`` (seconds; size in elements or bytes), with the fit's R^2."""

    a: float
    b: float
    r2: float
    n: int

    def predict(self, size: float) -> float:
        return max(0.0, self.a + self.b * size)


def model_key(rec: TaskRecord) -> str:
    """Which model a record feeds: comm, codec (C/D), experts (forward / backward) or the
    shared experts' side task (S_forward / S_backward)."""
    kind = rec.task.kind[0]
    if kind in ("E", "S"):
        return f"{kind}_{rec.phase}"
    return {"A": "A", "C": "C", "D": "D"}[kind]


def fit_linear(sizes: list[float], times: list[float]) -> LinearModel:
    x, y = np.asarray(sizes, float), np.asarray(times, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return LinearModel(float(y.mean()) if len(y) else 0.0, 0.0, 0.0, len(x))
    A = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    resid = y - (a + b * x)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - (resid ** 2).sum() / total if total > 0 else 1.0
    return LinearModel(float(a), float(b), float(r2), len(x))


def fit_models(records: list[TaskRecord]) -> dict[str, LinearModel]:
    """One model per task group, fitted to the median time at each distinct size (medians keep
    a shared, noisy machine's outliers out of the fit)."""
    groups: dict[str, dict[int, list[float]]] = {}
    for rec in records:
        groups.setdefault(model_key(rec), {}).setdefault(rec.size, []).append(rec.end - rec.start)
    return {k: fit_linear(list(by_size), [float(np.median(v)) for v in by_size.values()])
            for k, by_size in groups.items()}


def profile(layer: torch.nn.Module, x: torch.Tensor, degrees: list[int], reps: int,
            warmup: int = 1) -> tuple[list[TaskRecord], list[float]]:
    """Run forward + backward ``warmup + reps`` times per pipelining degree with the sequential
    scheduler (no overlap, so each task is timed alone); return the timed task records and the
    whole forward + backward times (device time on CUDA)."""
    from moeflow.schedule import SCHEDULERS

    saved = (layer.cfg, layer.scheduler, layer.timeline)
    timeline = Timeline()
    records: list[TaskRecord] = []
    steps: list[float] = []
    try:
        layer.scheduler = SCHEDULERS["sequential"]()
        layer.timeline = timeline
        for r in degrees:
            layer.cfg = layer.cfg.replace(pipeline_degree=r)
            for i in range(warmup + reps):
                synchronize(x.device)               # earlier work is not this step's
                timeline.clear()
                watch = Stopwatch(x.device).start()
                layer_step(layer, x)
                seconds = watch.stop()
                if i >= warmup:
                    steps.append(seconds)
                    records.extend(timeline.records)
    finally:
        layer.cfg, layer.scheduler, layer.timeline = saved
        layer.zero_grad(set_to_none=True)
    return records, steps
