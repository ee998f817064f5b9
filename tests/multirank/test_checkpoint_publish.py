"""Checkpoints are published atomically: a crash between writing a checkpoint and publishing it
leaves the previous one in use, and a resume from it continues exactly (docs/training.md)."""

from __future__ import annotations

import multiprocessing
import signal
import warnings

import pytest
import torch

from moeflow import checkpoint
from moeflow.topology import Topology
from moeflow.trainer import FaultConfig, Trainer, latest_checkpoint
from tests.helpers import fault_injection
from tests.helpers.fault_injection import MICRO_MODEL, MICRO_TRAIN


def _params(trainer: Trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_kill_between_write_and_publish_uses_the_previous_checkpoint(tmp_path):
    run = tmp_path / "killed"
    proc = multiprocessing.get_context("spawn").Process(
        target=fault_injection.kill_before_publish,
        args=(str(run), 4, torch.get_num_threads()))   # same threads: the same floats
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    root = run / "checkpoint"
    assert (root / ".step-4.partial").is_dir()           # written, never published
    assert checkpoint.is_complete(root / ".step-4.partial")
    assert not (root / "step-4").exists()
    assert (root / "latest").read_text() == "step-2"
    with pytest.warns(RuntimeWarning, match=r"skipped unpublished \.step-4\.partial"):
        path, step = latest_checkpoint(run)
    assert (path.name, step) == ("step-2", 2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        resumed = Trainer(MICRO_MODEL, MICRO_TRAIN, run, Topology.single(), progress=False)
        res = resumed.run(resume=True)
    assert res["start_step"] == 2 and res["step"] == 6
    assert not (root / ".step-4.partial").exists()       # re-written and published
    assert (root / "latest").read_text() == "step-6"
    full = Trainer(MICRO_MODEL, MICRO_TRAIN, tmp_path / "full", Topology.single(),
                   progress=False)
    ref = full.run()
    assert res["final_val_loss"] == ref["final_val_loss"]
    got, want = _params(resumed), _params(full)
    for name, p in want.items():
        assert torch.equal(got[name], p), name


def _fake(root, step, complete=True):
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / ".metadata").write_bytes(b"x")
    return path


def test_latest_naming_an_incomplete_folder_falls_back_with_a_warning(tmp_path):
    _fake(tmp_path, 2)
    _fake(tmp_path, 4, complete=False)
    (tmp_path / "latest").write_text("step-4")
    with pytest.warns(RuntimeWarning, match="'step-4', which is missing or incomplete"):
        assert checkpoint.find_latest(tmp_path) == (tmp_path / "step-2", 2)
    (tmp_path / "latest").write_text("step-2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # the normal case: no warning
        assert checkpoint.find_latest(tmp_path) == (tmp_path / "step-2", 2)
    assert checkpoint.find_latest(tmp_path / "none") is None


def test_publish_renames_and_replaces_latest(tmp_path):
    staged = checkpoint.staging_path(tmp_path, 3)
    staged.mkdir()
    with pytest.raises(RuntimeError, match="incomplete"):
        checkpoint.publish(staged, tmp_path, 3)
    (staged / ".metadata").write_bytes(b"x")
    assert checkpoint.publish(staged, tmp_path, 3) == tmp_path / "step-3"
    assert not staged.exists() and (tmp_path / "latest").read_text() == "step-3"
    staged.mkdir()                                       # the same step again (redone)
    (staged / ".metadata").write_bytes(b"y")
    checkpoint.publish(staged, tmp_path, 3)
    assert (tmp_path / "step-3" / ".metadata").read_bytes() == b"y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-3"]


def test_fault_config_validation():
    with pytest.raises(Exception, match="--keep-checkpoints: FaultConfig.keep_checkpoints=0"):
        FaultConfig(keep_checkpoints=0)
    with pytest.raises(Exception, match="--max-restarts: FaultConfig.max_restarts=-1"):
        FaultConfig(max_restarts=-1)
    assert FaultConfig(keep_checkpoints=1).keep_checkpoints == 1
