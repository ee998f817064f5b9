"""Plan records: what a checkpointed MoE layer's first forward decided, replayed by its
recomputation in backward.

Under ``torch.utils.checkpoint`` (reentrant or not) a MoE layer's forward runs twice: once in
forward, once more when the backward needs its activations. Everything the first forward
*decided* is reused, not decided again: the routing choices (the top-k expert ids; the gate
values are recomputed from them, so they still carry gradient), the dispatch plan with its
count matrix (exchanged once per call, so the recomputation issues no count exchange), the
tuner's choice (the config, all-to-all algorithm, codecs, scheduler and, with
``placement="auto"``, strategy the call ran with, even if a re-tune happened in between), Parm's per-call schedule, and FSSDP's ``P'`` (HECATE
Section 3.2: the load window is entered once per step and Algorithm 1 does not run again).
The recomputation then issues the first forward's collectives minus the count exchange, with
the same sizes on every rank. Megatron-core's MoE recompute reuses the dispatch metadata the
same way: its recomputed region starts after the token dispatcher's ``probs`` / routing map
are fixed (``transformer/moe/moe_layer.py``, ``moe_act`` / ``moe`` recompute modules).

A record belongs to one checkpoint call: the non-reentrant checkpoint's ``_CheckpointFrame``
(found through the saved-tensor hooks that checkpoint installs, in forward and in the
recomputation) or the reentrant ``CheckpointFunction`` node (its ``ctx``, found on the Python
stack in ``forward`` and in ``backward``). Records hang on that object, so they live and die
with the checkpointed graph; several calls of one layer inside one region are told apart by
their order, which the recomputation repeats. A forward outside any checkpoint records
nothing. These are torch internals (2.x); where they are not found the recomputation plans
again, as before (correct, with the extra count exchange).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._autograd import _top_saved_tensors_default_hooks

_ATTR = "_moeflow_plan_records"


@dataclass
class PlanRecord:
    """One layer call's decisions: ``experts`` the routing choices, ``call`` the strategy's
    :class:`~moeflow.strategies.base.Call` (top-k, capacity factor, plan with its counts,
    Parm's schedule, FSSDP's ``P'``), ``settings`` (cfg, algo, codec, backward_codec,
    scheduler, strategy) of the call, and its counters (the backward's counts land in them)."""
    experts: torch.Tensor
    call: Any
    settings: tuple
    nonfinite: torch.Tensor | None = None
    inter_bytes: torch.Tensor | None = None
    replays: int = field(default=0)      # how many recomputations consumed it


def _closure(fn) -> dict:
    out = {}
    while fn is not None:
        for name, cell in zip(getattr(fn.__code__, "co_freevars", ()), fn.__closure__ or ()):
            try:
                out[name] = cell.cell_contents
            except ValueError:
                pass
        fn = getattr(fn, "__wrapped__", None)
    return out


def _codes() -> tuple:
    from torch.utils.checkpoint import CheckpointFunction
    return (CheckpointFunction.forward.__code__, CheckpointFunction.backward.__code__)


def region() -> tuple[str, object] | None:
    """``("forward" | "recompute", key)`` of the innermost checkpoint call running now, or
    None outside checkpointing. ``key`` is the object the records hang on. Under
    ``torch.compile`` it is None (dynamo cannot trace the hook and frame lookups, and a graph
    break here would split the block): a compiled, checkpointed layer plans again in its
    recomputation, which is correct, with one more count exchange."""
    if torch.compiler.is_compiling():
        return None
    hooks = _top_saved_tensors_default_hooks(False)
    if hooks is not None:                # non-reentrant: the frame, in forward or recompute
        cells = _closure(hooks[0])
        frame = cells.get("frame")
        if frame is not None and hasattr(frame, "recompute_fn"):
            return "forward", frame
        ref = cells.get("target_frame_ref")
        if isinstance(ref, weakref.ReferenceType) and ref() is not None:
            return "recompute", ref()
    fwd, bwd = _codes()
    f = sys._getframe(1)
    for _ in range(200):                 # reentrant: the CheckpointFunction node
        if f is None:
            break
        if f.f_code is fwd or f.f_code is bwd:
            ctx = f.f_locals.get("ctx")
            if ctx is not None:
                return ("forward" if f.f_code is fwd else "recompute"), ctx
        f = f.f_back
    return None


def _table(key) -> dict | None:
    try:
        table = getattr(key, _ATTR, None)
        if table is None:
            table = {"records": {}, "replayed": {}}
            setattr(key, _ATTR, table)
        return table
    except (AttributeError, TypeError):
        return None


def save(where: tuple[str, object] | None, layer, record: PlanRecord) -> None:
    """Keep ``record`` of a first forward inside a checkpoint (nothing outside one)."""
    if where is None or where[0] != "forward":
        return
    table = _table(where[1])
    if table is not None:
        table["records"].setdefault(id(layer), []).append(record)


def take(where: tuple[str, object] | None, layer) -> PlanRecord | None:
    """The record a recomputation of ``layer`` replays: the region's next one for this layer
    in call order (per backward graph task: a graph backwarded twice recomputes twice), or
    None (not a recomputation, or nothing recorded)."""
    if where is None or where[0] != "recompute":
        return None
    table = _table(where[1])
    if table is None:
        return None
    records = table["records"].get(id(layer), [])
    slot = (id(layer), torch._C._current_graph_task_id())
    i = table["replayed"].get(slot, 0)
    if i >= len(records):
        return None
    table["replayed"][slot] = i + 1
    records[i].replays += 1
    return records[i]


def recomputing() -> bool:
    """Whether a checkpoint's recomputation is running now."""
    where = region()
    return where is not None and where[0] == "recompute"


__all__ = ["PlanRecord", "region", "recomputing", "save", "take"]
