"""The overlapped forward / backward pair's machinery on one process (no ranks): the strict
turns of moeflow.pipeline_parallel.overlap_fb (DeepSeek-V3 Section 3.2.1) and the all-to-all
clock of moeflow.pipeline_parallel.a2a_clock with a stand-in work handle; the float64 parity
of the overlapped dualpipev is in test_pipeline.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moeflow.comm import wait_watch
from moeflow.comm.alltoall.base import Pending
from moeflow.pipeline_parallel.a2a_clock import A2AClock
from moeflow.pipeline_parallel.overlap_fb import BACKWARD, FORWARD, Turns


def _party(turns: Turns, name: str, steps: int, log: list, errors: list):
    def body():
        try:
            turns.begin(name)
            for i in range(steps):
                log.append((name, i))
                turns.pass_turn()
        except BaseException as e:
            errors.append(e)
        finally:
            turns.finish(name)
    return threading.Thread(target=body)


@pytest.mark.parametrize("f_steps, b_steps", [(3, 3), (4, 1), (1, 4), (0, 2)])
def test_turns_alternate_strictly_forward_first(f_steps, b_steps):
    for _ in range(20):            # the same order every time, whatever the thread timing
        turns, log, errors = Turns(timeout_s=10), [], []
        threads = [_party(turns, BACKWARD, b_steps, log, errors),
                   _party(turns, FORWARD, f_steps, log, errors)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not errors
        expect = []
        for i in range(max(f_steps, b_steps)):
            expect += [(FORWARD, i)] * (i < f_steps) + [(BACKWARD, i)] * (i < b_steps)
        assert log == expect


def test_turn_wait_is_bounded():
    turns = Turns(timeout_s=0.2)
    with pytest.raises(RuntimeError, match="backward waited 0.2 s for its turn"):
        turns.begin(BACKWARD)           # the forward never hands it over


class _Work:
    """A stand-in work handle completing ``after`` seconds after it was made."""

    def __init__(self, after: float):
        self.fut = torch.futures.Future()
        threading.Timer(after, self.fut.set_result, args=(None,)).start()

    def get_future(self):
        return self.fut

    def wait(self):
        self.fut.wait()


def test_clock_times_exposed_against_total():
    clock = A2AClock()
    previous = wait_watch.install(clock)
    try:
        work = _Work(0.2)
        hidden = Pending(lambda: work.wait() or "a", work)
        time.sleep(0.3)                 # compute that hides the whole exchange
        assert hidden.wait() == "a"
        work = _Work(0.2)
        exposed = Pending(lambda: work.wait() or "b", work)
        assert exposed.wait() == "b"    # waited for at once: all of it exposed
        assert Pending(lambda: "c").wait() == "c"       # no work handle: not timed
    finally:
        wait_watch.install(previous)
    t = clock.take()
    assert t["a2a_count"] == 2 and t["a2a_handed"] == 0
    assert 0.15 <= t["a2a_exposed_s"] < 0.3      # the second exchange only
    assert 0.35 <= t["a2a_total_s"] < 0.6
    assert clock.take()["a2a_count"] == 0       # taken: reset
