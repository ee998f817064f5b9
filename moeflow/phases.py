"""Wall-clock split of one MoE layer's forward and backward into its phases.

Forward phases are timed directly. Backward is split with identity autograd nodes ("marks")
placed on each phase's output: when the gradient passes a mark, the time since the previous
mark fired is charged to the phase whose backward just finished. On CUDA the timer
synchronises the device at each boundary (so timing changes overlap; use it for breakdowns,
not for end-to-end speed).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self):
        self.forward: dict[str, float] = defaultdict(float)
        self.backward: dict[str, float] = defaultdict(float)
        self._last_bwd: float | None = None

    def reset(self) -> None:
        self.forward.clear()
        self.backward.clear()
        self._last_bwd = None

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
        self.forward[name] += time.perf_counter() - t0

    def mark(self, t: torch.Tensor, name: str | None) -> torch.Tensor:
        """Identity on ``t``; in backward charges elapsed time to ``name`` (None: start clock)."""
        if not t.requires_grad:
            return t
        return _Mark.apply(t, self, name)

    def _fire(self, name: str | None, grad: torch.Tensor) -> None:
        self._sync(grad)
        now = time.perf_counter()
        if name is not None and self._last_bwd is not None:
            self.backward[name] += now - self._last_bwd
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

    @contextmanager
    def phase(self, name: str, like: torch.Tensor | None = None):
        yield

    def mark(self, t: torch.Tensor, name: str | None) -> torch.Tensor:
        return t


NULL_TIMER = NullTimer()
