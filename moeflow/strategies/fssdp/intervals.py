"""Host-wait-free interval timing for HECATE's measured inputs (Algorithm 1's ``T_non-MoE``,
the per-token expert time of the calibration, Section 4.2).

On CUDA an interval is a pair of events; :meth:`LazyInterval.seconds` returns the last interval
whose end event has completed (``query()``, never ``synchronize``), so reading it on the hot
path does not make the host wait. On CPU it is ``time.perf_counter``.
"""

from __future__ import annotations

import time

import torch


class LazyInterval:
    def __init__(self):
        self._cpu_start: float | None = None
        self._events: tuple | None = None
        self._last = 0.0
        self.started = False             # whether start() was ever called

    def start(self, device: torch.device) -> None:
        self.started = True
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events = (ev, None)
            self._cpu_start = None
        else:
            self._cpu_start, self._events = time.perf_counter(), None

    def stop(self) -> None:
        if self._cpu_start is not None:
            self._last = time.perf_counter() - self._cpu_start
            self._cpu_start = None
        elif self._events is not None and self._events[1] is None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events = (self._events[0], end)

    def seconds(self) -> float:
        """The last completed interval in seconds (0 before the first)."""
        if self._events is not None and self._events[1] is not None \
                and self._events[1].query():
            self._last = self._events[0].elapsed_time(self._events[1]) / 1e3
            self._events = None
        return self._last


__all__ = ["LazyInterval"]
