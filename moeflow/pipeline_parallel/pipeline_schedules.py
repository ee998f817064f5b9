"""The pipeline schedules of ``moeflow train --pp-schedule``: torch.distributed.pipelining's
(GPipe; 1F1B, Narayanan et al. 2021, "PipeDream-Flush"; interleaved 1F1B, Narayanan et al. 2021
Section 2.2; ZB-V, Qi et al. 2024 "Zero Bubble Pipeline Parallelism" Section 4; DualPipeV,
DeepSeek-V3 Section 3.2.1 in its V-shaped form), and where each puts the virtual stages.

Single-stage schedules (gpipe, 1f1b) give pipeline rank ``r`` stage ``r``. The interleaved 1F1B
gives it two stages in a loop, ``r`` and ``r + pp``; the V schedules (zbv, dualpipev) two
stages in a V, ``r`` and ``2 pp - 1 - r``, so the first and the last stage share rank 0.
"""

from __future__ import annotations

from typing import Callable

from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                    "interleaved-1f1b": ScheduleInterleaved1F1B,
                    "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
VIRTUAL_STYLE = {"interleaved-1f1b": "loop", "zbv": "v", "dualpipev": "v"}
VIRTUAL_STAGES_PER_RANK = 2


def stages_per_rank(schedule: str) -> int:
    """Stages a pipeline rank holds under ``schedule``: 2 where it uses virtual stages."""
    return VIRTUAL_STAGES_PER_RANK if schedule in VIRTUAL_STYLE else 1


def num_stages(schedule: str, pp: int) -> int:
    return pp * stages_per_rank(schedule)


def stage_ids(schedule: str, pp: int, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds, in increasing order."""
    style = VIRTUAL_STYLE.get(schedule)
    if style is None:
        return [pp_rank]
    if style == "loop":
        return [pp_rank + k * pp for k in range(VIRTUAL_STAGES_PER_RANK)]
    return [pp_rank, 2 * pp - 1 - pp_rank]


def build_schedule(schedule: str, stages: list, n_micro: int, loss_fn: Callable):
    """torch's schedule object over this rank's ``stages`` (``PipelineStage``s). Gradients are
    not scaled by the schedule (``scale_grads=False``): ``loss_fn`` returns the micro-batch's
    share of the step's loss (its mean divided by ``n_micro``), as the unpipelined
    accumulation's backward does."""
    cls = SCHEDULE_CLASSES[schedule]
    if schedule in VIRTUAL_STYLE:
        return cls(stages, n_micro, loss_fn=loss_fn, scale_grads=False)
    (stage,) = stages
    return cls(stage, n_micro, loss_fn=loss_fn, scale_grads=False)
