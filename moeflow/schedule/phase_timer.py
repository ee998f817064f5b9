"""Wall-clock split of one MoE layer's forward and backward into its phases.

Route, permute and combine are timed directly in forward; in backward they are split with
identity autograd nodes ("marks") placed on each phase's input: when the gradient passes a mark,
the time since the previous mark fired is charged to that phase. The exchange + experts block
runs as scheduled tasks (``moeflow.schedule``) whose records land in ``timeline``; their
durations are charged to ``all_to_all`` (compress, all-to-all, decompress) and ``experts``.
With an overlapping scheduler those phases overlap, so they can add up to more than the step.
On CUDA the timer synchronises the device at each boundary (use it for breakdowns, not for
end-to-end speed).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from moeflow.schedule.executor import Timeline

TASK_PHASE = {"C1": "all_to_all", "A1": "all_to_all", "D1": "all_to_all", "E": "experts",
              "C2": "all_to_all", "A2": "all_to_all", "D2": "all_to_all"}


class PhaseTimer:
    def __init__(self):
        self._forward: dict[str, float] = defaultdict(float)
        self._backward: dict[str, float] = defaultdict(float)
        self._last_bwd: float | None = None
        self.timeline = Timeline()

    def reset(self) -> None:
        self._forward.clear()
        self._backward.clear()
        self._last_bwd = None
        self.timeline.clear()

    def _with_tasks(self, direct: dict[str, float], phase: str) -> dict[str, float]:
        out = defaultdict(float, direct)
        for rec in self.timeline.records:
            if rec.phase == phase:
                out[TASK_PHASE[rec.task.kind]] += rec.end - rec.start
        return out

    @property
    def forward(self) -> dict[str, float]:
        return self._with_tasks(self._forward, "forward")

    @property
    def backward(self) -> dict[str, float]:
        return self._with_tasks(self._backward, "backward")

    @staticmethod
    def _sync(t: torch.Tensor | None = None) -> None:
        if t is not None and t.is_cuda:
            torch.cuda.synchronize(t.device)

    @contextmanager
    def phase(self, name: str, like: torch.Tensor | None = None):
        self._sync(like)
        t0 = time.perf_counter()
        yield
        self._sync(like)
        self._forward[name] += time.perf_counter() - t0

    def mark(self, t: torch.Tensor, name: str | None) -> torch.Tensor:
        """Identity on ``t``; in backward charges the time since the previous mark to ``name``
        (None: only restart the clock, for spans accounted elsewhere)."""
        if not t.requires_grad:
            return t
        return _Mark.apply(t, self, name)

    def _fire(self, name: str | None, grad: torch.Tensor) -> None:
        self._sync(grad)
        now = time.perf_counter()
        if name is not None and self._last_bwd is not None:
            self._backward[name] += now - self._last_bwd
        self._last_bwd = now


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, timer, name):
        ctx.timer, ctx.name = timer, name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer._fire(ctx.name, grad)
        return grad, None, None


class NullTimer:
    """The timer used when no breakdown is asked for: no clocks, no marks."""

    timeline = None

    @contextmanager
    def phase(self, name: str, like: torch.Tensor | None = None):
        yield

    def mark(self, t: torch.Tensor, name: str | None) -> torch.Tensor:
        return t


NULL_TIMER = NullTimer()
