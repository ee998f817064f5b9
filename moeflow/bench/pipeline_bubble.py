"""The pipeline bubble a schedule leaves in theory, from the times of one chunk's forward (F),
input backward (B) and weight backward (W), for ``moeflow bench pipeline`` to set beside the
measured idle share of each rank.

A chunk is one stage on one micro-batch; a rank runs ``v`` stages (1 for gpipe and 1f1b, 2
for the others) on ``m`` micro-batches, so its work is ``v m (F + B + W)`` and its pipeline time
is that plus the bubble. The bubble, per schedule (``p`` pipeline ranks):

- gpipe, 1f1b: ``(p - 1)(F + B + W)`` (GPipe, Huang et al. 2019 Section 2.2; 1F1B, Narayanan
  et al. 2021 Section 2.2.1): the share ``(p - 1) / (m + p - 1)``;
- interleaved-1f1b: ``(p - 1)(F + B + W)`` with the chunk times of a stage that is ``1 / v``
  of the rank's model part (Narayanan et al. 2021 Section 2.2.2: the bubble shrinks by ``v``):
  the share ``(p - 1) / (v m + p - 1)``;
- zbv: ``(p - 1)(F + B - 2W)``, at least 0 (zero-bubble pipelines, Qi et al. 2024; the
  form DeepSeek-V3 Section 3.2.1 Table 2 gives for ZB1P, taken per chunk of the V);
- dualpipev: ``(p - 1)(F&B + B - 3W)``, at least 0, where ``F&B`` is the time of an
  overlapped forward-and-backward pair (``F + B`` when nothing overlaps): DeepSeek-V3 Section
  3.2.1 Table 2 gives ``(PP/2 - 1)(F&B + B - 3W)`` for DualPipe on PP ranks; its V form on
  ``p`` ranks runs the same ``2p`` stages (``PP = 2p``).

Where a stage computes its weight gradients in its input step (moeflow's MoE stages,
docs/training.md), ``W`` is 0 and the zero-bubble forms have nothing to fill the bubble with.
"""

from __future__ import annotations

from moeflow.errors import ConfigError
from moeflow.pipeline_parallel.pipeline_schedules import stages_per_rank


def bubble_time(schedule: str, p: int, f: float, b: float, w: float = 0.0,
                fb: float | None = None) -> float:
    """Seconds of one rank's pipeline time with no chunk running (the formulas above)."""
    if p < 1:
        raise ConfigError(f"pipeline ranks p={p} is invalid: it must be >= 1")
    if schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        return (p - 1) * (f + b + w)
    if schedule == "zbv":
        return max(0.0, (p - 1) * (f + b - 2 * w))
    if schedule == "dualpipev":
        return max(0.0, (p - 1) * ((f + b if fb is None else fb) + b - 3 * w))
    raise ConfigError(f"--pp-schedule {schedule!r} has no bubble formula; choose one of "
                      "gpipe, 1f1b, interleaved-1f1b, zbv, dualpipev")


def bubble_share(schedule: str, p: int, m: int, f: float, b: float, w: float = 0.0,
                 fb: float | None = None) -> float:
    """The bubble's share of a rank's pipeline time: bubble / (bubble + its chunks' work)."""
    if m < 1:
        raise ConfigError(f"micro-batches m={m} is invalid: it must be >= 1")
    work = stages_per_rank(schedule) * m * (f + b + w)
    idle = bubble_time(schedule, p, f, b, w, fb)
    return idle / (idle + work) if idle + work > 0 else 0.0
