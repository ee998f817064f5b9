"""Run a schedule for real: computing tasks on the calling thread, communication tasks on a
lane (ScheMoE section 3.2, "task queue").

A lane is a single worker thread, so communication tasks run one at a time in the order they
are issued, which is the same on every rank (the issue order is fixed by the schedule), keeping
collectives matched. With ``overlap=False`` (the sequential scheduler) they run inline instead.
Every task's start and end are recorded for the timeline and the profiler.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from moeflow.schedule.schedulers import Scheduler
from moeflow.schedule.tasks import Task


@dataclass
class TaskRecord:
    task: Task
    phase: str          # "forward" or "backward"
    lane: str           # "compute" or "comm"
    start: float        # perf_counter seconds
    end: float
    size: int           # elements (compute) or bytes on the wire (comm)


@dataclass
class Timeline:
    records: list[TaskRecord] = field(default_factory=list)

    def clear(self) -> None:
        self.records.clear()


class CommLane:
    """One communication lane: a single background thread (created on first use)."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[[], Any]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeflow-comm")
        return self._pool.submit(fn)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # A lane is a resource, not state: copies and pickles of a layer get a fresh one.
    def __deepcopy__(self, memo) -> "CommLane":
        return CommLane()

    def __getstate__(self) -> dict:
        return {"_pool": None}


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


@dataclass
class Stage:
    """The seven task functions of one pass (forward or backward) over r chunks.

    Each takes the chunk index and the previous task's result and returns
    ``(result, size)``; ``size`` is recorded for the profiler.
    """

    fns: dict[str, Callable[[int, Any], tuple[Any, int]]]


def run_schedule(stage: Stage, r: int, scheduler: Scheduler, lane: CommLane,
                 timeline: Timeline | None, phase: str) -> list[Any]:
    """Execute the 7r tasks; return the D2 results of the r chunks in chunk order."""
    results: dict[Task, Any] = {}
    pending: dict[Task, Future] = {}

    def record(task: Task, lane_name: str, t0: float, size: int) -> None:
        if timeline is not None:
            timeline.records.append(TaskRecord(task, phase, lane_name, t0,
                                               time.perf_counter(), size))

    def comm(task: Task, arg: Any) -> Any:
        t0 = time.perf_counter()
        out, size = stage.fns[task.kind](task.chunk, arg)
        record(task, "comm", t0, size)
        return out

    for task in scheduler.order(r):
        pred = task.predecessor()
        if pred is not None and pred.is_comm:
            arg = pending.pop(pred).result()
        else:
            arg = results.pop(pred, None) if pred is not None else None
        t0 = time.perf_counter()
        out, size = stage.fns[task.kind](task.chunk, arg)
        record(task, "compute", t0, size)
        if task.kind in ("C1", "C2"):
            a = Task("A1" if task.kind == "C1" else "A2", task.chunk)
            pending[a] = (lane.submit(lambda a=a, out=out: comm(a, out)) if scheduler.overlap
                          else _done(comm(a, out)))
        else:
            results[task] = out
    return [results[Task("D2", i)] for i in range(r)]
