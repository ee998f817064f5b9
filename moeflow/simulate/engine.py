"""An event-driven model of lanes, dependencies and collectives across ranks.

Each rank has lanes (its computing lane, its communication lane: the executor's single worker
thread, :mod:`moeflow.schedule.executor`); each lane runs its tasks one at a time in the order
they were queued (issue order), a task starting when the lane is free and its dependencies
have ended (ScheMoE Eq. 13-14, generalised to several ranks). Tasks of one collective (same
``collective`` key on every rank) start together, when every member can start, and end
together after the slowest member's time: a collective completes when its last participant
does. A collective that some rank never reaches, or ranks reaching collectives in different
orders, leaves lanes stuck; that is reported as an error rather than a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimTask:
    name: str                   # "C1^1", "route", ...
    rank: int
    lane: str                   # the lane it is reported on ("compute", "comm")
    runs_on: str                # the lane whose order it takes ("compute" for inline comm)
    phase: str                  # "forward" / "recompute" (a checkpoint's rerun) / "backward"
    seconds: float
    deps: list["SimTask"] = field(default_factory=list)
    collective: str | None = None    # same key on every rank = one collective
    size: int = 0               # elements (compute) or bytes on the wire (comm), as recorded
    link: str | None = None     # the link class of a communication task
    stage: str | None = None    # the step of an all-to-all ("all_to_all", "intra", "inter")
    remote_bytes: int = 0       # bytes of it sent to other nodes
    ranks: tuple | None = None  # the group's global ranks (Parm / HECATE collectives)
    elements: int = 0           # elements this rank puts in (the tracer's count), if recorded
    start: float | None = None
    end: float | None = None

    def record(self) -> dict:
        return {"task": self.name, "rank": self.rank, "lane": self.lane, "phase": self.phase,
                "start_s": self.start, "end_s": self.end, "size": self.size,
                **({"link": self.link} if self.link else {}),
                **({"stage": self.stage} if self.stage else {}),
                **({"collective": self.collective} if self.collective else {}),
                **({"ranks": list(self.ranks), "elements": self.elements}
                   if self.ranks is not None else {})}


def run(lanes: dict[tuple[int, str], list[SimTask]]) -> float:
    """Set every task's start and end; return the makespan. ``lanes[(rank, name)]`` lists that
    lane's tasks in issue order."""
    heads = {k: 0 for k in lanes}
    free = {k: 0.0 for k in lanes}
    members: dict[str, list[SimTask]] = {}
    for tasks in lanes.values():
        for t in tasks:
            if t.collective is not None:
                members.setdefault(t.collective, []).append(t)
    left = sum(len(v) for v in lanes.values())
    while left:
        progress = False
        for key, tasks in lanes.items():
            while heads[key] < len(tasks):
                t = tasks[heads[key]]
                group = members[t.collective] if t.collective is not None else [t]
                ready = []
                for m in group:
                    mk = (m.rank, m.runs_on)
                    if (heads[mk] >= len(lanes[mk]) or lanes[mk][heads[mk]] is not m
                            or any(d.end is None for d in m.deps)):
                        break
                    ready.append(max([free[mk]] + [d.end for d in m.deps]))
                else:
                    start = max(ready)
                    end = start + max(m.seconds for m in group)
                    for m in group:
                        m.start, m.end = start, end
                        mk = (m.rank, m.runs_on)
                        free[mk] = end
                        heads[mk] += 1
                    left -= len(group)
                    progress = True
                    continue
                break
        if not progress:
            stuck = {f"rank {k[0]} {k[1]}": str(v[heads[k]].name) for k, v in lanes.items()
                     if heads[k] < len(v)}
            raise RuntimeError(f"the simulated step deadlocks: lanes wait at {stuck} (a "
                               "collective not reached by every rank, or reached in different "
                               "orders)")
    return max((t.end for v in lanes.values() for t in v), default=0.0)
