"""How long each rank waited on the MoE layers' all-to-all during a pipeline step (the
*exposed* time) against the exchanges' whole time, so that the share an overlapped schedule
hides (DeepSeek-V3 Section 3.2.1, DualPipe) can be compared with 1F1B's.

:class:`A2AClock` is the :mod:`moeflow.comm.wait_watch` watcher that
:class:`~moeflow.pipeline_parallel.runner.PipelineRunner` installs for its schedule's step.
For each exchange in flight it stamps the issue, the completion (from the work handle's
future, a callback: no host wait is added) and the ``wait()`` (the exposed part):

- ``a2a_total_s``: summed issue-to-completion time of the exchanges;
- ``a2a_exposed_s``: summed time the rank blocked in their ``wait()``;
- ``a2a_count``: how many exchanges (dispatch and combine, forward and backward);
- ``a2a_handed``: how many of them handed the turn to the other micro-batch of an overlapped
  pair before waiting (0 without overlap).

The hidden share of a run is ``1 - a2a_exposed_s / a2a_total_s``. Inside an overlapped forward
/ backward pair (:mod:`moeflow.pipeline_parallel.overlap_fb`) the clock also hands the turn to
the other micro-batch before it waits, so that micro-batch computes while the exchange is in
flight.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class A2AClock:
    def __init__(self):
        self._lock = threading.Lock()
        self.turns = None          # the running overlapped pair's Turns, else None
        self.exposed_s = self.total_s = 0.0
        self.count = self.handed = 0

    def issued(self, work: Any) -> dict:
        stamp = {"issued": time.perf_counter(), "done": None}
        future = work.get_future() if hasattr(work, "get_future") else None
        if future is not None:
            future.add_done_callback(
                lambda _f, s=stamp: s.__setitem__("done", time.perf_counter()))
        return stamp

    def wait(self, stamp: dict, wait: Callable[[], Any]) -> Any:
        turns = self.turns
        if turns is not None:       # the other micro-batch computes while this one is in flight
            if turns.pass_turn():
                with self._lock:
                    self.handed += 1
        t0 = time.perf_counter()
        out = wait()
        t1 = time.perf_counter()
        done = stamp["done"]
        # a completion callback not run yet (it runs on the backend's thread) ends by now
        end = t1 if done is None or done > t1 else done
        with self._lock:
            self.exposed_s += t1 - t0
            self.total_s += max(end - stamp["issued"], t1 - t0)
            self.count += 1
        return out

    def take(self) -> dict[str, float]:
        """The sums since the last ``take`` (and reset them)."""
        with self._lock:
            out = {"a2a_exposed_s": self.exposed_s, "a2a_total_s": self.total_s,
                   "a2a_count": float(self.count), "a2a_handed": float(self.handed)}
            self.exposed_s = self.total_s = 0.0
            self.count = self.handed = 0
        return out
