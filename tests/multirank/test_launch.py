"""Launching ranks, and bounded failure: a rank that hangs or dies never hangs the others."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from moeflow.launch import launch_local


def _rank_and_world():
    return dist.get_rank(), dist.get_world_size()


def _fail_during_collective(mode: str):
    if dist.get_rank() == 1:
        if mode == "die":
            os._exit(7)
        time.sleep(120)                      # a hung rank: never joins the collective
    dist.all_reduce(torch.ones(4))           # rank 0 waits here
    return "finished"


@pytest.mark.multirank
def test_launch_local_returns_per_rank_results():
    assert launch_local(_rank_and_world, 2) == {0: (0, 2), 1: (1, 2)}


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["hang", "die"])
def test_failed_rank_fails_the_job_in_bounded_time(mode):
    start = time.monotonic()
    with pytest.raises(ChildFailedError) as err:
        launch_local(_fail_during_collective, 2, mode, timeout_s=4)
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"took {elapsed:.0f}s: a failure must not hang the job"
    failures = err.value.failures
    if mode == "hang":       # rank 0's collective timed out with an error of its own
        assert 0 in failures
        message = str(failures[0].message).lower()
        assert "timed out" in message or "timeout" in message, message
    else:
        assert failures[min(failures)].exitcode != 0
