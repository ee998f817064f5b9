"""Run a schedule for real: computing tasks on the calling thread, communication tasks on a
lane (ScheMoE section 3.2, "task queue"; lanes and streams in :mod:`.streams`).

A lane is a single worker thread, so communication tasks run one at a time in the order they
are issued, which is the same on every rank (the issue order is fixed by the schedule), keeping
collectives matched. With ``overlap=False`` (the sequential scheduler) they run inline instead,
on the same stream they would use on the lane. A communication task's result is waited for
where it is consumed (its successor D), as a stream dependency on CUDA.

If a task raises, every communication task already issued is drained (waited for, its own
errors dropped) before the exception propagates, so a caller that catches it and goes on never
has this step's collectives interleaved with the next step's.

A side task (``side``: the shared experts, task ``S``) runs on the computing lane right before
the first task that consumes a communication result, i.e. where the computing lane would
otherwise wait for the first all-to-all (with the sequential scheduler, which overlaps
nothing, that point comes after the all-to-all has run inline). It adds no host wait.

A collective that a computing task needs inside itself (Parm's ESP-AllReduce of the expert
shards' partial outputs, inside task E: Parm Section II-B, Fig. 3a) is issued through
:func:`on_lane`: while a schedule runs, it becomes a communication task queued on the lane
behind the all-to-alls already issued, and the computing lane waits for it as a consumer of
its result (the same hand-off as A1 / A2). So every collective issued while the lane has work
in flight is issued by the lane, in the schedule's order, which is the same on every rank:
NCCL's rule that every rank issues one communicator's operations in the same order, and that
two threads must not issue into different communicators in a rank-dependent order
(docs/design.md, "One collective order per rank").

Every task's start and end are recorded for the timeline and the profiler (CUDA events on GPUs,
resolved when the timeline is read).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moeflow.schedule.schedulers import Scheduler
from moeflow.schedule.streams import Clock, CommLane, Handoff
from moeflow.schedule.tasks import SIDE, Task

__all__ = ["CommLane", "Stage", "TaskRecord", "Timeline", "on_lane", "run_schedule"]


@dataclass
class TaskRecord:
    task: Task
    phase: str          # "forward" or "backward"
    lane: str           # "compute" or "comm"
    start: float        # seconds (perf_counter on CPU; CUDA event times on GPUs)
    end: float
    size: int           # elements (compute) or bytes on the wire (comm)


@dataclass
class Timeline:
    """Task records of the runs made while attached to a layer (``layer.timeline``).

    On CUDA the stamps are events; reading ``records`` synchronises once and converts them to
    seconds on the host clock (anchored at the first event), so only the reader waits.
    """

    _records: list[TaskRecord] = field(default_factory=list)
    _pending: list[tuple] = field(default_factory=list)
    _anchor: tuple | None = None

    def add(self, task: Task, phase: str, lane: str, start, end, size: int) -> None:
        if isinstance(start, float):
            self._records.append(TaskRecord(task, phase, lane, start, end, size))
        else:
            self._pending.append((task, phase, lane, start, end, size))

    @property
    def records(self) -> list[TaskRecord]:
        if self._pending:
            import time

            torch.cuda.synchronize()
            if self._anchor is None:
                self._anchor = (self._pending[0][3], time.perf_counter())
            ev0, t0 = self._anchor
            for task, phase, lane, s, e, size in self._pending:
                self._records.append(TaskRecord(task, phase, lane,
                                                t0 + ev0.elapsed_time(s) / 1e3,
                                                t0 + ev0.elapsed_time(e) / 1e3, size))
            self._pending.clear()
            self._records.sort(key=lambda rec: rec.start)
        return self._records

    def clear(self) -> None:
        self._records.clear()
        self._pending.clear()

    def overlap_fraction(self, phase: str | None = None) -> float:
        """Fraction of communication time during which a computing task also ran (0 when no
        communication was recorded): how much of the all-to-all the schedule hid."""
        from moeflow.schedule.overlap import overlap_fraction

        return overlap_fraction(self.records, phase)


@dataclass
class Stage:
    """The seven task functions of one pass (forward or backward) over r chunks.

    Each takes the chunk index and the previous task's result and returns
    ``(result, size)``; ``size`` is recorded for the profiler.
    """

    fns: dict[str, Callable[[int, Any], tuple[Any, int]]]


_ISSUER = threading.local()      # .issue: the running schedule's way onto its lane, or None


def on_lane(collective: Callable[[], Any], tensors: Any = ()) -> Any:
    """Run ``collective`` (a function issuing collectives on ``tensors``, made or read by the
    computing lane, and returning what the computing lane needs) where the current thread's
    collectives belong: inside a task of :func:`run_schedule`, as a communication task of
    that schedule's lane (queued behind its pending all-to-alls, waited for here); elsewhere
    (no schedule running on this thread), right here."""
    issue = getattr(_ISSUER, "issue", None)
    return collective() if issue is None else issue(collective, tensors)


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _drain(pending: dict[Task, Future]) -> None:
    for fut in pending.values():
        try:
            fut.result()
        except BaseException:       # the first error is the one that propagates
            pass
    pending.clear()


def run_schedule(stage: Stage, r: int, scheduler: Scheduler, lane: CommLane,
                 timeline: Timeline | None, phase: str,
                 device: torch.device | None = None,
                 side: Callable[[int, Any], tuple[Any, int]] | None = None) -> list[Any]:
    """Execute the 7r tasks (and the side task ``S`` if given, its result discarded: it
    returns through its own closure); return the D2 results of the r chunks in chunk
    order."""
    device = device or torch.device("cpu")
    handoff, clock = Handoff(lane, device), Clock(device)
    results: dict[Task, Any] = {}
    pending: dict[Task, Future] = {}

    fns = dict(stage.fns, **({SIDE: side} if side is not None else {}))

    def timed(task: Task, lane_name: str, arg: Any) -> Any:
        t0 = clock.stamp()
        out, size = fns[task.kind](task.chunk, arg)
        if timeline is not None:
            timeline.add(task, phase, lane_name, t0, clock.stamp(), size)
        return out

    def comm(task: Task, payload: Any, ready) -> tuple[Any, Any]:
        handoff.enter(ready, payload)
        out = timed(task, "comm", payload)
        return out, handoff.leave()

    def issue(collective: Callable[[], Any], tensors: Any) -> Any:
        """:func:`on_lane` inside a task: the collective as a lane task, consumed at once."""
        ready = handoff.ready()

        def task():
            handoff.enter(ready, tensors)
            return collective(), handoff.leave()

        out, done = (lane.submit(task, device).result() if scheduler.overlap
                     else lane.run(task, device))
        handoff.consume(done, tensors)
        return out

    side_pending = side is not None
    outer, _ISSUER.issue = getattr(_ISSUER, "issue", None), issue
    try:
        for task in scheduler.order(r):
            pred = task.predecessor()
            if pred is not None and pred.is_comm:
                if side_pending:         # the computing lane would wait here: run S first
                    timed(Task(SIDE, 0), "compute", None)
                    side_pending = False
                arg, done = pending.pop(pred).result()
                handoff.consume(done, arg)
            else:
                arg = results.pop(pred, None) if pred is not None else None
            out = timed(task, "compute", arg)
            if task.kind in ("C1", "C2"):
                a = Task("A1" if task.kind == "C1" else "A2", task.chunk)
                fn = (lambda a=a, out=out, ready=handoff.ready(): comm(a, out, ready))
                pending[a] = (lane.submit(fn, device) if scheduler.overlap
                              else _done(lane.run(fn, device)))
            else:
                results[task] = out
        if side_pending:
            timed(Task(SIDE, 0), "compute", None)
    except BaseException:
        _drain(pending)
        raise
    finally:
        _ISSUER.issue = outer
    return [results[Task("D2", i)] for i in range(r)]
