"""A process-wide watcher of the all-to-all exchanges in flight (:class:`Pending` handles).

The pipeline schedules of ``moeflow train --pp`` install one for the length of a step
(:mod:`moeflow.pipeline_parallel.a2a_clock`): it is told when an exchange was issued (with its
work handle, whose completion it stamps from the handle's future: no host wait) and runs
every ``wait()``, so that it can time the part of the exchange the rank waited for (the
*exposed* time) against its whole time, and, in DualPipe's overlapped forward / backward pair
(DeepSeek-V3 Section 3.2.1), hand the turn to the other micro-batch's compute before waiting.
Without a watcher (the default) ``Pending`` waits directly.

The watcher is process-wide, not per thread: on CUDA the autograd engine runs a backward's
exchanges on its device thread, which must be seen as well.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class WaitWatcher(Protocol):
    def issued(self, work: Any) -> Any:
        """An exchange was issued with ``work`` (a ``torch.distributed`` work handle); return
        a token passed back to :meth:`wait`."""

    def wait(self, token: Any, wait: Callable[[], Any]) -> Any:
        """Run ``wait()`` (blocks until the exchange is done) and return its result."""


_WATCHER: list[WaitWatcher | None] = [None]


def current() -> WaitWatcher | None:
    return _WATCHER[0]


def install(watcher: WaitWatcher | None) -> WaitWatcher | None:
    """Make ``watcher`` the process's (None: none); return the previous one."""
    previous, _WATCHER[0] = _WATCHER[0], watcher
    return previous
