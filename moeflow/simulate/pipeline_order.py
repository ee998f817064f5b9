"""The order in which each pipeline rank runs its stages' chunks, taken from torch's own
schedule classes (``torch.distributed.pipelining``), so that the simulated order is the one
``moeflow train --pp`` executes.

Every torch schedule class computes its whole ``pipeline_order`` (rank -> actions) in its
constructor, with a method that reads only the pipeline size, the micro-batch count and the
stages per rank: ``_get_pipeline_order`` of the single-stage schedules (GPipe, Huang et al.
2019 Section 2.2; 1F1B, Narayanan et al. 2021 Section 2.2.1), ``_calculate_single_rank_
operations(rank)`` of the multi-stage ones (interleaved 1F1B, Narayanan et al. 2021 Section
2.2.2; ZB-V, Qi et al. 2024 Section 6; DualPipeV, DeepSeek-V3 Section 3.2.1). :func:`torch_order`
calls that method on an instance given exactly those attributes, without building stages or
process groups (a change of those private methods fails the tests, not silently).

One exception: ``Schedule1F1B`` does not run its ``pipeline_order`` (its ``_step_microbatches``
loop runs the schedule), and that order mislabels the micro-batches of the last rank (its first
forward is micro-batch 1, micro-batch 0's forward is missing; torch 2.13). Its order is the
loop's (:func:`one_f_one_b_order`): ``min(m, p - r)`` warm-up forwards on rank ``r``, then a
backward and a forward in turn, then the remaining backwards.

An action here is :class:`Act`: ``kind`` ``F`` (forward), ``B`` (full backward), ``I``
(backward of the input), ``W`` (backward of the weights) or ``FB`` (DualPipeV's overlapped
forward / backward pair, its two halves in ``sub``); torch's idle slots (``None``) and its
gradient reduction markers are left out: a rank waits for what an action depends on, not for a
slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.errors import ConfigError

KINDS = ("F", "B", "I", "W", "FB")
_TORCH_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I",
                "BACKWARD_WEIGHT": "W", "OVERLAP_F_B": "FB"}


@dataclass(frozen=True)
class Act:
    kind: str                   # F, B, I, W, FB
    stage: int                  # the stage index (-1 for FB)
    mb: int                     # the micro-batch (-1 for FB)
    sub: tuple["Act", ...] = ()  # FB: (the forward, the full backward)

    def __str__(self) -> str:
        if self.kind == "FB":
            return "(" + "&".join(str(a) for a in self.sub) + ")"
        return f"{self.stage}{self.kind}{self.mb}"


def _convert(action) -> Act | None:
    name = action.computation_type.name
    kind = _TORCH_KINDS.get(name)
    if kind is None:             # REDUCE_GRAD and the like: no compute of a chunk
        return None
    if kind == "FB":
        return Act("FB", -1, -1, tuple(_convert(a) for a in action.sub_actions))
    return Act(kind, action.stage_index, action.microbatch_index)


def one_f_one_b_order(pp: int, n_micro: int) -> dict[int, list[Act]]:
    """The order ``Schedule1F1B._step_microbatches`` runs on each rank (stage = rank)."""
    out = {}
    for rank in range(pp):
        warm = min(n_micro, pp - rank)
        acts = [Act("F", rank, mb) for mb in range(warm)]
        f, b = warm, 0
        while True:
            acts.append(Act("B", rank, b))
            b += 1
            if f == n_micro:
                break
            acts.append(Act("F", rank, f))
            f += 1
        acts.extend(Act("B", rank, mb) for mb in range(b, n_micro))
        out[rank] = acts
    return out


def torch_order(schedule_cls, pp: int, n_micro: int, stages_per_rank: int) -> dict[int, list[Act]]:
    """``{pipeline rank: its actions in execution order}`` of torch's ``schedule_cls`` on
    ``pp`` ranks, ``n_micro`` micro-batches, ``stages_per_rank`` stages per rank (1: a
    single-stage schedule)."""
    if pp < 1 or n_micro < 1:
        raise ConfigError(f"torch_order: pp={pp}, n_micro={n_micro} must be >= 1")
    if schedule_cls.__name__ == "Schedule1F1B":
        return one_f_one_b_order(pp, n_micro)
    sched = schedule_cls.__new__(schedule_cls)
    sched._n_microbatches = n_micro
    if stages_per_rank == 1:
        sched._num_stages = pp
        order = sched._get_pipeline_order()
    else:
        rounds = max(1, n_micro // pp)
        sched.pp_group_size = pp
        sched.n_local_stages = stages_per_rank
        sched.num_stages = sched._num_stages = pp * stages_per_rank
        sched.number_of_rounds = rounds
        sched.microbatches_per_round = n_micro // rounds
        order = {r: sched._calculate_single_rank_operations(r) for r in range(pp)}
    if order is None:
        raise ConfigError(f"{schedule_cls.__name__} states no pipeline order")
    out = {}
    for rank in range(pp):
        acts = [_convert(a) for a in order[rank] if a is not None]
        out[rank] = [a for a in acts if a is not None]
    return out


def format_order(order: dict[int, list[Act]]) -> str:
    """One line per rank: ``rank 0: 0F0 0F1 1F0 ...``."""
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts)
                     for r, acts in sorted(order.items()))


__all__ = ["Act", "KINDS", "format_order", "one_f_one_b_order", "torch_order"]
