"""What ``moeflow train`` shows and records: one tuner line per tuned layer and batch shape
(the screening detail in the run folder), the gradient norm with the loss, and reproducible
runs under ``--deterministic`` (docs/training.md, "Reproducible runs")."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from moeflow.cli import build_parser
from moeflow.commands.train_command import configs_from_args
from moeflow.config import ConfigError, TrainConfig, model_preset
from moeflow.trainer import check_deterministic

TINY = ["--batch-size", "2", "--eval-batches", "1", "--eval-every", "3", "--warmup-steps",
        "1", "--log-every", "1", "--set", "seq_len=32"]


def _train(out, *extra: str, steps: int = 3) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moeflow.cli", "train", "--steps", str(steps), *TINY,
           "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(out) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in _jsonl(out / "metrics.jsonl")
            if "loss" in r]


@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned") / "run"
    return out, _train(out)                        # with the progress bar, as a user sees it


@pytest.mark.multirank
def test_the_tuner_prints_one_line_per_layer_and_shape(tuned_run):
    out, done = tuned_run
    lines = [ln.strip() for ln in done.stderr.replace("\r", "\n").splitlines()
             if ln.strip().startswith("autotune")]
    records = _jsonl(out / "autotune.jsonl")
    assert records and all(r["source"] == "measured" for r in records)
    assert len({(r["layer_id"], r["tokens"]) for r in records}) == len(records)
    assert len(lines) == len(records), lines
    for line, rec in zip(lines, records):
        c = rec["choice"]
        assert f"layer_id {rec['layer_id']}" in line and f"{rec['tokens']} tokens" in line
        assert (f"a2a={c['a2a']} schedule={c['schedule']} r={c['pipeline_degree']}" in line
                and " in " in line), line
    assert not any(w in done.stderr for w in ("screen", "profiled", "measure "))
    detail = (out / "autotune.log").read_text()      # the screening detail: in the run folder
    assert "screen 1/" in detail and "profiled" in detail


@pytest.mark.multirank
def test_the_gradient_norm_is_logged_with_the_loss(tuned_run):
    out, done = tuned_run
    norms = [n for _, _, n in _losses(out)]
    assert len(norms) == 3 and all(math.isfinite(n) and n > 0 for n in norms)
    assert "gnorm=" in done.stderr                     # the progress line


@pytest.mark.multirank
@pytest.mark.slow          # the one-process tests/unit/core/test_train_tuned_choices.py guards --deterministic
def test_deterministic_runs_log_identical_losses(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        _train(out, "--deterministic", "--no-progress", steps=6)
    first, second = (_losses(out) for out in runs)
    assert len(first) == 6 and first == second            # exactly equal, every step
    for out in runs:                                       # fixed, not measured, recorded
        recs = _jsonl(out / "autotune.jsonl")
        assert recs and {r["source"] for r in recs} == {"fixed defaults"}
        assert {(r["choice"]["a2a"], r["choice"]["schedule"], r["choice"]["pipeline_degree"])
                for r in recs} == {("direct", "sequential", 1)}
        tuned = json.loads((out / "checkpoint" / "step-6" / "autotune.json").read_text())
        assert {c["pipeline_degree"] for c in tuned.values()} == {1}     # in the checkpoint


@pytest.mark.multirank
@pytest.mark.slow          # the one-process tests/unit/core/test_train_tuned_choices.py guard it
def test_tuned_from_starts_with_the_recorded_choices_and_a_resume_keeps_them(tuned_run,
                                                                              tmp_path):
    src, _ = tuned_run
    want = {r["layer_id"]: r["choice"] for r in _jsonl(src / "autotune.jsonl")}
    out = tmp_path / "run"
    _train(out, "--deterministic", "--tuned-from", str(src), "--no-progress", steps=2)
    recs = _jsonl(out / "autotune.jsonl")
    assert {r["source"] for r in recs} == {f"--tuned-from {src}"}
    assert {r["layer_id"]: r["choice"] for r in recs} == want
    _train(out, "--deterministic", "--resume", "--no-progress", steps=3)
    resumed = _jsonl(out / "autotune.jsonl")[len(recs):]
    assert {r["source"] for r in resumed} == {"checkpoint"}
    assert {r["layer_id"]: r["choice"]["pipeline_degree"] for r in resumed} == \
        {k: c["pipeline_degree"] for k, c in want.items()}


def test_deterministic_and_tuned_from_reach_the_train_config():
    args = build_parser().parse_args(["train", "--deterministic", "--tuned-from", "runs/x"])
    _, tcfg = configs_from_args(args)
    assert (tcfg.deterministic, tcfg.tuned_from) == (True, "runs/x")
    _, plain = configs_from_args(build_parser().parse_args(["train"]))
    assert (plain.deterministic, plain.tuned_from) == (False, None)


def test_deterministic_refuses_parm_auto_and_a_missing_record(tmp_path, capsys):
    mcfg = model_preset("tiny", moe={"parallel_schedule": "auto"})
    with pytest.raises(ConfigError, match="parallel_schedule='auto'"):
        check_deterministic(mcfg, TrainConfig(deterministic=True))
    check_deterministic(mcfg, TrainConfig())                  # measured: allowed
    from moeflow.cli import main
    with pytest.raises(SystemExit) as err:
        main(["train", "--nproc", "1", "--tuned-from", str(tmp_path)])
    assert err.value.code == 2 and "no autotune.jsonl" in capsys.readouterr().err
