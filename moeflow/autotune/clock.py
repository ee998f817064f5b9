"""The auto-tuner's time budget (``MoEConfig.autotune_budget_s``; ScheMoE section 3.2 profiles
on the running cluster, this bounds what that costs).

The tuner (moeflow/autotune/tuner.py) asks :meth:`TuneClock.fits` before each piece of timed work
whether the rest of the budget still holds ``steps`` more layer steps. Every rank must take the
same decision, or the ranks that go on would wait in collectives the others never enter; so
the elapsed time is the slowest rank's (one host all-reduce of a float per question), and the
step estimate is built only from step times that are themselves the slowest rank's
(:func:`moeflow.measure.timing.time_aligned`). Both are the same number on every rank, hence so
is the answer. With ``budget_s=None`` every question is answered yes without communicating.
"""

from __future__ import annotations

import time

from moeflow.topology import Topology


class TuneClock:
    """Wall time since the tuning started, against ``budget_s`` seconds (None: unbounded)."""

    def __init__(self, budget_s: float | None, topo: Topology):
        self.budget_s, self.topo = budget_s, topo
        self.t0 = time.perf_counter()
        self.step_s = 0.0                   # the latest step estimate (slowest rank's)
        self.max_step_s = 0.0               # the longest timed step (slowest rank's)
        self.cut: list[str] = []            # what the budget cut short, in order

    def local_elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def note_step(self, seconds: float, estimate: bool = True) -> None:
        """Record a step time (the slowest rank's: equal on every rank); with ``estimate``
        (or while there is none yet) it becomes the estimate of the next steps' length.
        Warm-up steps and error probes are not estimates: a slow codec's probe would make
        the next candidates look as slow."""
        if estimate or self.step_s == 0.0:
            self.step_s = seconds
        self.max_step_s = max(self.max_step_s, seconds)

    def fits(self, steps: float) -> bool:
        """Whether ``steps`` more steps of the current estimate end within the budget; the
        same answer on every rank (collective when a budget is set: all ranks must ask)."""
        if self.budget_s is None:
            return True
        from moeflow.measure.timing import slowest

        return slowest(self.local_elapsed(), self.topo) + steps * self.step_s <= self.budget_s

    def note_cut(self, what: str) -> None:
        self.cut.append(what)
