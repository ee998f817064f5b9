"""CPU checks of the first GPU run's script (``tests/gpu/first_run.sh`` ->
``tests/gpu/first_run.py``; docs/gpu.md, "First run on one GPU"): its ``moeflow train``
arguments parse with the real CLI parser into the intended configs, the report has its table
and sections, and (slow) the whole train section runs on the CPU: SIGUSR1 preemption (exit
75) and ``--resume``."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from moeflow.commands import train_command as cmd
from tests.gpu import first_run

REPO = Path(first_run.__file__).resolve().parents[2]


def _parse(argv):
    p = argparse.ArgumentParser()
    cmd.register(p.add_subparsers())
    return p.parse_args(argv)


@pytest.mark.parametrize("resume", [False, True])
def test_train_arguments_parse_with_the_real_cli(tmp_path, resume):
    args = _parse(first_run.train_argv("cuda", tmp_path, 60, 16, resume=resume))
    mcfg, tcfg = cmd.configs_from_args(args)
    fault = cmd.fault_config(args)
    assert (args.device, args.nproc, args.resume) == ("cuda", 1, resume)
    assert tcfg.grad_accum == 2 and tcfg.recompute == "moe_act" and tcfg.steps == 60
    assert fault.async_checkpoint and args.out == str(tmp_path)


def test_the_script_forwards_its_arguments_to_the_orchestrator():
    text = (REPO / "tests" / "gpu" / "first_run.sh").read_text()
    assert 'exec python -m tests.gpu.first_run "$@"' in text
    assert first_run.BUDGET_S <= 8 * 60


def test_report_format(tmp_path):
    sections = [first_run.Section("triton", "pass", 12.5, "exit 0: 30 passed", ["ok"]),
                first_run.Section("probe", "fail", 3.0, "a | b", ["{}"]),
                first_run.Section("train", "skipped", 0.0, "the time budget is spent")]
    path = tmp_path / "report.md"
    first_run.write_report(path, sections, "cpu", 480)
    text = path.read_text()
    assert text.startswith("# moeflow first GPU run\n")
    assert "| section | status | seconds | detail |" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "section" not in ln]
    assert rows == ["| triton | pass | 12.5 | exit 0: 30 passed |",
                    "| probe | fail | 3.0 | a / b |",
                    "| train | skipped | 0.0 | the time budget is spent |"]
    assert all(f"## {s.name}" in text for s in sections)
    assert "- budget 480 s, used 16 s" in text


@pytest.mark.slow
def test_train_section_preempts_and_resumes_on_cpu(tmp_path):
    done = subprocess.run(["bash", str(REPO / "tests" / "gpu" / "first_run.sh"), "--device",
                           "cpu", "--out", str(tmp_path), "--train-steps", "10",
                           "--batch-size", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / "report.md").read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| train |"))
    assert "| pass |" in row and "by SIGUSR1 (exit 75), resumed to step 10" in row
    for name in ("triton", "probe", "pytest_gpu"):
        assert f"| {name} | skipped | 0.0 | needs --device cuda |" in text
