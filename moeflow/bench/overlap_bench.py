"""Measures how much of the all-to-all a schedule hides on real layer steps: the median
:func:`moeflow.schedule.overlap.overlap_fraction` over forward + backward steps (ScheMoE
section 4), for ``moeflow bench layer``'s ``overlap`` column (its pipelined ``--schedules``
rows). Only the ``layer.timeline`` /
``Timeline.records`` interface is used, which every scheduler version of moeflow has: copied
with ``moeflow/schedule/overlap.py`` into an older checkout, it measures that engine the same
way (docs/benchmarks/layer.md does that).
"""

from __future__ import annotations

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
