"""The tasks of one pipelined MoE layer and their data dependencies (ScheMoE Eq. 3-9).

Besides the 7r chunk tasks, a layer with shared experts has one side task ``S`` (the shared
experts on this rank's tokens, forward or backward): a computing task that depends on no
chunk task and that nothing but the layer's output depends on. The executor runs it where the
computing lane would first wait for an all-to-all (:func:`moeflow.schedule.executor.
run_schedule`), so it overlaps the dispatch all-to-all; schedulers order only the chunk tasks.
"""

from __future__ import annotations

from typing import NamedTuple

KINDS = ("C1", "A1", "D1", "E", "C2", "A2", "D2")   # chain order within a chunk (Eq. 4-9)
COMM = ("A1", "A2")
COMPUTE = ("C1", "D1", "E", "C2", "D2")
SIDE = "S"              # the shared experts' task (one per pass, no chunk dependencies)


class Task(NamedTuple):
    kind: str
    chunk: int          # 0-based; the paper's superscript i is chunk + 1

    def __str__(self) -> str:
        return f"{self.kind}^{self.chunk + 1}"

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM

    def predecessor(self) -> "Task | None":
        """The task this one waits for within its chunk (Eq. 4-9); None for C1."""
        k = KINDS.index(self.kind)
        return Task(KINDS[k - 1], self.chunk) if k else None


def check_order(order: list[Task], r: int) -> None:
    """Raise ValueError unless ``order`` lists each computing task of r chunks once, and every
    task after its same-chunk computing predecessors."""
    expected = {Task(k, i) for i in range(r) for k in COMPUTE}
    if len(order) != len(expected) or set(order) != expected:
        raise ValueError(f"a schedule must list the {len(expected)} computing tasks "
                         f"{sorted(map(str, expected))} exactly once; got {list(map(str, order))}")
    seen: set[Task] = set()
    for t in order:
        p = t.predecessor()
        while p is not None and p.is_comm:
            p = p.predecessor()
        if p is not None and p not in seen:
            raise ValueError(f"schedule runs {t} before {p}, which it depends on")
        seen.add(t)
