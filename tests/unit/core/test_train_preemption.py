"""Preemption in one process (``moeflow/trainer.py``, docs/training.md "Failures"): a SIGTERM that
arrives during a step makes the trainer finish that step, publish its checkpoint, write
``preempted.json`` and return; resuming reaches the uninterrupted run's exact result.

The same contract over 2 ranks launched by ``moeflow train`` (the signal agreed across ranks,
exit code 75) is ``tests/multirank/test_train_restart.py``'s signal test, marked slow."""

from __future__ import annotations

import json
import os
import signal

import pytest

from moeflow import checkpoint
from moeflow.topology import Topology
from moeflow.trainer import PREEMPTED_FILE, Trainer
from tests.helpers.fault_injection import MICRO_MODEL, MICRO_TRAIN


def _trainer(out) -> Trainer:
    return Trainer(MICRO_MODEL, MICRO_TRAIN, out, Topology.single(), progress=False)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_checkpoints_the_reached_step_and_resume_equals_the_uninterrupted_run(
        tmp_path, signum):
    full = _trainer(tmp_path / "full").run()
    assert full["preempted"] is None and full["step"] == MICRO_TRAIN.steps

    trainer = _trainer(tmp_path / "cut")
    step_fn = trainer.train_step

    def step_then_signal():
        if trainer.step == 2:                        # arrives while step 3 runs
            os.kill(os.getpid(), signum)
        return step_fn()

    trainer.train_step = step_then_signal
    cut = trainer.run()
    assert cut["step"] == 3 < MICRO_TRAIN.steps      # the step in flight finished, no more
    assert cut["preempted"]["signal"] == signal.Signals(signum).name
    rec = json.loads((tmp_path / "cut" / PREEMPTED_FILE).read_text())
    assert rec["step"] == 3 and rec["signal"] == signal.Signals(signum).name
    assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step-3"
    assert [p.name for _, p in checkpoint.published(tmp_path / "cut" / "checkpoint")][-1] \
        == "step-3"
    assert signal.getsignal(signum) is not trainer._on_signal   # handlers restored

    resumed = _trainer(tmp_path / "cut").run(resume=True)
    assert resumed["start_step"] == 3 and resumed["step"] == MICRO_TRAIN.steps
    assert resumed["final_loss"] == full["final_loss"]
    assert resumed["final_val_loss"] == full["final_val_loss"]
    assert not (tmp_path / "cut" / PREEMPTED_FILE).exists()
