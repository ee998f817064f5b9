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


def build_eval_schedule(schedule: str, stages: list, n_micro: int, pp: int,
                        loss_fn: Callable):
    """The forward-only schedule of validation for ``schedule``'s stage placement: torch's own
    training schedule (its ``eval``) where one stage per rank, else torch's schedule runtime
    over a forward-only action list (torch's multi-stage ``eval`` runs the training actions,
    which the V schedules' same-rank backward hand-over refuses without a backward): every
    rank runs its stages in increasing index, each over all micro-batches (GPipe's order,
    Huang et al. 2019 Section 2.2), and torch adds the sends and receives."""
    if schedule not in VIRTUAL_STYLE:
        return None
    from torch.distributed.pipelining.schedules import (_Action, _add_send_recv,
                                                        _ComputationType,
                                                        _PipelineScheduleRuntime,
                                                        generate_stage_to_rank_mapping)

    runtime = _PipelineScheduleRuntime(stages, n_micro, loss_fn=loss_fn, scale_grads=False)
    style = VIRTUAL_STYLE[schedule]
    mapping = generate_stage_to_rank_mapping(pp, num_stages(schedule, pp), style=style)
    runtime.stage_index_to_group_rank = mapping
    for stage in stages:
        stage.stage_index_to_group_rank = mapping
    order = {r: [_Action(sid, _ComputationType.FORWARD, mb)
                 for sid in stage_ids(schedule, pp, r) for mb in range(n_micro)]
             for r in range(pp)}
    runtime.pipeline_order = order
    # torch's lowering adds the sends and receives (its validation of a compute-only order
    # asks for backwards, so the lowering is called directly)
    runtime.pipeline_order_with_comms = _add_send_recv(
        order, stage_to_rank=mapping.__getitem__, num_stages=num_stages(schedule, pp))
    return runtime


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
