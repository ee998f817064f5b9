"""Checkpoints of ``moeflow train --pp`` across pipeline layouts: PP 2 -> PP 2 resumes bit for
bit, PP 2 -> PP 1 -> PP 2 continues the same run to round-off
(tests/helpers/pipeline_resume_cases.py); a killed rank of a pipelined run is restarted by the
elastic agent and the run ends as the uninterrupted one, and so does a run preempted by
SIGUSR1 and resumed, and one whose checkpoints are written in the background."""

from __future__ import annotations

import pytest

from moeflow.launch import launch_local
from tests.helpers import pipeline_resume_cases as cases


@pytest.mark.multirank
@pytest.mark.slow
def test_checkpoints_load_across_pipeline_layouts(tmp_path):
    root = str(tmp_path)
    first = launch_local(cases.straight_and_resumed, 4, root, timeout_s=300)[0]
    straight = first["straight"]
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    # the same layout: the resumed run logs the straight run's losses bit for bit
    assert first["resumed"] == {s: straight[s] for s in (3, 4, 5, 6)}
    cases.copy_run(f"{root}/straight", f"{root}/pp1", 2)
    # --steps 6 as the straight run (the learning-rate schedule spans --steps)
    pp1 = launch_local(cases.resume, 2, f"{root}/pp1", 1, 6, timeout_s=300)[0]
    assert sorted(pp1) == [3, 4, 5, 6]
    cases.copy_run(f"{root}/pp1", f"{root}/pp2", 4)
    pp2 = launch_local(cases.resume, 4, f"{root}/pp2", 2, 6, timeout_s=300)[0]
    assert sorted(pp2) == [5, 6]
    for run in (pp1, pp2):                  # another layout: the same run to round-off
        for step, loss in run.items():
            assert loss == pytest.approx(straight[step], rel=1e-5), step


PP = ["--nproc", "4", "--pp", "2", "--grad-accum", "2", "--eval-batches", "2"]


@pytest.fixture(scope="module")
def pp_reference(tmp_path_factory):
    """The uninterrupted --pp 2 run of tests/multirank/test_train_restart.py's options: its
    final loss and validation loss."""
    from tests.multirank.test_train_restart import _final, _train

    tmp = tmp_path_factory.mktemp("pp_ref")
    ref = _train(tmp / "run", PP, None, tmp)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return _final(tmp / "run")


@pytest.mark.multirank
@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_the_pipelined_run_equals_the_uninterrupted_one(
        pp_reference, tmp_path):
    # the restart machinery of tests/multirank/test_train_restart.py, with --pp 2 on 4 ranks
    from tests.multirank.test_train_restart import _final, _records, _train

    out = tmp_path / "run"
    done = _train(out, [*PP, "--max-restarts", "1"], "kill:1:6", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _final(out) == pp_reference     # loss and validation loss, exactly
    assert [r["resumed_from_step"] for r in _records(out) if r.get("event") == "restart"] == [4]


@pytest.mark.multirank
@pytest.mark.slow
def test_preempted_pipelined_run_saves_and_resumes_to_the_uninterrupted_result(pp_reference,
                                                                              tmp_path):
    # the preemption of tests/multirank/test_train_restart.py (SIGUSR1), with --pp 2
    import json
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import fault_injection
    from tests.multirank.test_train_restart import (REPO, SMALL, _final, _records, _train,
                                                    _wait_for_step)

    out, hook = tmp_path / "run", tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(fault_injection.SITECUSTOMIZE)
    env = dict(os.environ, MOEFLOW_FAULT="slow:0:2:0.4",       # steps from 3 take 0.4 s
               PYTHONPATH=os.pathsep.join([str(hook), str(REPO),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "moeflow.cli", "train", *SMALL, *PP,
                             "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for_step(out, proc, 5)
        proc.send_signal(signal.SIGUSR1)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, stderr[-3000:]
    step = json.loads((out / "preempted.json").read_text())["step"]
    assert 5 <= step < 12
    assert [r["step"] for r in _records(out) if "loss" in r][-1] == step
    done = _train(out, [*PP, "--resume"], None, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _final(out) == pp_reference


@pytest.mark.multirank
@pytest.mark.slow
def test_async_checkpoints_of_a_pipelined_run_equal_the_sync_run(pp_reference, tmp_path):
    from moeflow import checkpoint
    from tests.multirank.test_train_restart import _final, _train

    out = tmp_path / "run"
    done = _train(out, [*PP, "--async-checkpoint"], None, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _final(out) == pp_reference
    assert [s for s, _ in checkpoint.published(out / "checkpoint")] == [4, 8, 12]
    again = _train(out, [*PP, "--resume", "--steps", "14"], None, tmp_path)
    assert again.returncode == 0 and "resumed from step 12" in again.stdout
