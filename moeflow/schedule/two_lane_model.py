"""A two-lane model of one schedule (ScheMoE section 4.1): predicted step time and timeline.

Computing tasks run one at a time in the scheduler's order; communication tasks run one at a
time on their own lane, each starting as soon as its input task has finished and the previous
communication task is done (first come, first served in issue order; Eq. 13-14). Constraints
(4)-(9) hold by construction. Used to check Theorem 1 by brute force and to predict the step
time of a configuration from profiled task times.
"""

from __future__ import annotations

from typing import Callable, Iterator

from moeflow.schedule.tasks import COMPUTE, Task

Times = Callable[[Task], float]


def simulate(order: list[Task], times: Times, overlap: bool = True
             ) -> tuple[float, list[tuple[Task, float, float]]]:
    """Makespan and ``[(task, start, end)]`` for a computing order.

    ``overlap=False`` runs each communication task inline on the computing lane.
    """
    end: dict[Task, float] = {}
    timeline: list[tuple[Task, float, float]] = []
    compute_free = comm_free = 0.0

    def run_comm(t: Task, ready: float) -> None:
        nonlocal comm_free, compute_free
        start = max(ready, comm_free if overlap else compute_free)
        end[t] = start + times(t)
        timeline.append((t, start, end[t]))
        if overlap:
            comm_free = end[t]
        else:
            compute_free = end[t]

    for t in order:
        pred = t.predecessor()
        start = max(compute_free, end[pred] if pred is not None else 0.0)
        end[t] = start + times(t)
        compute_free = end[t]
        timeline.append((t, start, end[t]))
        if t.kind in ("C1", "C2"):                      # issue its all-to-all
            run_comm(Task("A1" if t.kind == "C1" else "A2", t.chunk), end[t])
    return max(end.values()), timeline


def valid_orders(r: int) -> Iterator[list[Task]]:
    """Every order of the 5r computing tasks that respects each chunk's chain (brute force)."""
    chain = [k for k in COMPUTE]
    pos = [0] * r
    n = len(chain) * r
    order: list[Task] = []

    def rec() -> Iterator[list[Task]]:
        if len(order) == n:
            yield list(order)
            return
        for i in range(r):
            if pos[i] < len(chain):
                order.append(Task(chain[pos[i]], i))
                pos[i] += 1
                yield from rec()
                pos[i] -= 1
                order.pop()
    yield from rec()



def best_makespan(r: int, times: Times) -> tuple[float, list[Task]]:
    """The shortest makespan over *all* valid computing orders (exhaustive branch and bound).

    Depth-first over orders, simulating incrementally; a branch is cut when its computing lane
    plus the computing work still to do cannot beat the best order found so far. Exact: the
    bound never exceeds the true makespan of any completion.
    """
    chain = list(COMPUTE)
    best: list = [float("inf"), None]
    remaining = sum(times(Task(k, i)) for i in range(r) for k in chain)

    def rec(pos, end, compute_free, comm_free, order, work_left):
        if len(order) == len(chain) * r:
            span = max(end.values())
            if span < best[0]:
                best[0], best[1] = span, list(order)
            return
        if compute_free + work_left >= best[0]:
            return
        for i in range(r):
            if pos[i] == len(chain):
                continue
            t = Task(chain[pos[i]], i)
            pred = t.predecessor()
            start = max(compute_free, end[pred] if pred is not None else 0.0)
            finish = start + times(t)
            new_end = dict(end)
            new_end[t] = finish
            new_comm = comm_free
            if t.kind in ("C1", "C2"):
                a = Task("A1" if t.kind == "C1" else "A2", i)
                new_end[a] = max(finish, comm_free) + times(a)
                new_comm = new_end[a]
            pos[i] += 1
            order.append(t)
            rec(pos, new_end, finish, new_comm, order, work_left - times(t))
            order.pop()
            pos[i] -= 1

    rec([0] * r, {}, 0.0, 0.0, [], remaining)
    return best[0], best[1]
