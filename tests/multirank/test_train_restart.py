"""``moeflow train --max-restarts N``: torch's elastic agent restarts the ranks after a failure
and they resume by themselves from the latest complete checkpoint; the result equals the
uninterrupted run's exactly. ``--keep-checkpoints K`` keeps the newest K.

The default run keeps one restart (a killed rank) and the async checkpoints; the preemption by
a signal over 2 ranks (SIGTERM, SIGUSR1; ``tests/unit/core/test_train_preemption.py`` checks it
in one process in the default run) and the other variants (a hung rank, no restarts, the
FSSDP / Parm layouts) are marked slow: ``python -m pytest -m slow`` runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeflow import checkpoint
from moeflow.topology import Topology
from moeflow.trainer import FaultConfig, Trainer
from tests.helpers import fault_injection
from tests.helpers.fault_injection import MICRO_MODEL, MICRO_TRAIN

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--steps", "12", "--batch-size", "2", "--eval-every", "6", "--eval-batches", "1",
         "--warmup-steps", "2", "--log-every", "1", "--checkpoint-every", "4",
         "--set", "n_layers=2", "--set", "seq_len=32", "--set", "d_model=32",
         "--set", "n_heads=2", "--set", "moe.num_experts=4", "--set", "moe.d_expert=32",
         "--no-progress", "--nproc", "2"]


def _train(out: Path, extra: list[str], fault: str | None, tmp: Path, timeout=600):
    env = dict(os.environ)
    env.pop("MOEFLOW_FAULT", None)
    if fault:
        hook = tmp / "hook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(fault_injection.SITECUSTOMIZE)
        env["MOEFLOW_FAULT"] = fault
        env["PYTHONPATH"] = os.pathsep.join([str(hook), str(REPO), env.get("PYTHONPATH", "")])
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "moeflow.cli", "train", *SMALL,
                           "--out", str(out), *extra], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _final(out: Path) -> tuple[float, float]:
    recs = [r for r in _records(out) if r.get("step") == 12 and "loss" in r]
    return recs[-1]["loss"], recs[-1]["val_loss"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    done = _train(tmp / "run", [], None, tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return _final(tmp / "run")


@pytest.mark.multirank
def test_killed_rank_is_restarted_and_the_run_equals_the_uninterrupted_one(reference,
                                                                           tmp_path):
    out = tmp_path / "run"
    done = _train(out, ["--max-restarts", "1"], "kill:1:6", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _final(out) == reference                  # loss and validation loss, exactly
    restarts = [r for r in _records(out) if r.get("event") == "restart"]
    assert len(restarts) == 1
    assert restarts[0]["restart"] == 1
    assert restarts[0]["resumed_from_step"] == 4 and restarts[0]["steps_redone"] == 2
    assert "restart 1 resumed from step 4 and redid 2 steps" in done.stdout
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["restarts"][0]["steps_redone"] == 2


@pytest.mark.multirank
@pytest.mark.slow
def test_without_restarts_a_killed_rank_fails_the_run(tmp_path):
    done = _train(tmp_path / "run", [], "kill:1:2", tmp_path)
    assert done.returncode == 1
    assert "rank 1" in done.stderr and "SIGKILL" in done.stderr


def test_keep_checkpoints_keeps_the_newest(tmp_path):
    trainer = Trainer(MICRO_MODEL, MICRO_TRAIN, tmp_path, Topology.single(), progress=False,
                      fault=FaultConfig(keep_checkpoints=2))
    trainer.run()
    root = tmp_path / "checkpoint"
    assert [p.name for _, p in checkpoint.published(root)] == ["step-4", "step-6"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-4", "step-6"]


def test_bad_fault_flags_are_clear_errors(capsys):
    from moeflow.cli import main

    for argv, message in ((["--keep-checkpoints", "0"], "--keep-checkpoints: "),
                          (["--max-restarts", "-1"], "--max-restarts: ")):
        with pytest.raises(SystemExit) as err:
            main(["train", *argv])
        assert err.value.code == 2
        assert message in capsys.readouterr().err


def _wait_for_step(out: Path, proc, step: int, timeout: float = 300) -> None:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        path = out / "metrics.jsonl"
        if path.exists() and any(r.get("step", 0) >= step for r in _records(out)):
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {step} (exit {proc.poll()})")


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGUSR1"])
def test_signal_saves_at_the_reached_step_and_resume_equals_the_uninterrupted_run(
        reference, tmp_path, signum):
    import signal

    out = tmp_path / "run"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(fault_injection.SITECUSTOMIZE)
    env = dict(os.environ, MOEFLOW_FAULT="slow:0:2:0.4",       # steps from 3 take 0.4 s
               PYTHONPATH=os.pathsep.join([str(hook), str(REPO),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "moeflow.cli", "train", *SMALL,
                             "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for_step(out, proc, 5)
        proc.send_signal(getattr(signal, signum))
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, stderr[-3000:]
    rec = json.loads((out / "preempted.json").read_text())
    step = rec["step"]
    assert rec["signal"] == signum and 5 <= step < 12
    assert f"preempted by {signum}: checkpoint at step {step}" in stdout
    assert (out / "checkpoint" / "latest").read_text() == f"step-{step}"
    steps = [r["step"] for r in _records(out) if "loss" in r]
    assert steps[-1] == step                         # every rank stopped after that step
    done = _train(out, ["--resume"], None, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from step {step}" in done.stdout
    assert _final(out) == reference
    assert not (out / "preempted.json").exists()


@pytest.mark.multirank
@pytest.mark.slow
def test_a_hung_rank_times_out_and_the_restart_finishes_the_run(reference, tmp_path):
    """Rank 1 sleeps past --timeout before step 7: rank 0's collective raises, the agent
    restarts both ranks, and the run ends as the uninterrupted one."""
    out = tmp_path / "run"
    done = _train(out, ["--max-restarts", "1", "--timeout", "20"], "sleep:1:6:60", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _final(out) == reference
    restarts = [r for r in _records(out) if r.get("event") == "restart"]
    assert [(r["resumed_from_step"], r["steps_redone"]) for r in restarts] == [(4, 2)]


@pytest.mark.multirank
@pytest.mark.slow   # the default run: tests/unit/cuda/test_cuda_review2_host.py (the async save's path), the restart above
def test_async_checkpoints_publish_every_save_and_equal_the_sync_run(reference, tmp_path):
    out = tmp_path / "run"
    done = _train(out, ["--async-checkpoint"], None, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _final(out) == reference
    root = out / "checkpoint"
    assert [s for s, _ in checkpoint.published(root)] == [4, 8, 12]
    assert not list(root.glob(".step-*"))
    saves = [json.loads(line) for line in (out / "checkpoints.jsonl").read_text().splitlines()]
    assert [(r["step"], r["async"]) for r in saves] == [(4, True), (8, True), (12, True)]
    again = _train(out, ["--resume", "--steps", "14"], None, tmp_path)   # loads as any other
    assert again.returncode == 0 and "resumed from step 12" in again.stdout


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    # HECATE FSSDP, re-sharded by Algorithm 2 every 2 steps: owners move between checkpoints
    ["--set", "moe.placement=fssdp", "--set", 'moe.fssdp={"reshard_every": 2}'],
    # Parm: MP over both ranks (the MoE input replicated), S2 with its plan check
    ["--mp", "2", "--set", "moe.parallel_schedule=s2", "--set", "moe.parm_check_plan=true"],
], ids=["fssdp_reshard", "parm_mp2_s2"])
def test_fssdp_and_parm_layouts_restart_to_the_uninterrupted_result(layout, tmp_path):
    ref = _train(tmp_path / "ref", layout, None, tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "run"
    done = _train(out, [*layout, "--max-restarts", "1"], "kill:1:6", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _final(out) == _final(tmp_path / "ref")     # loss and validation loss, exactly
    assert [r["resumed_from_step"] for r in _records(out) if r.get("event") == "restart"] == [4]
