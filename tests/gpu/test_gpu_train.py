"""A 50-step ``moeflow train`` on one GPU (a subprocess of the real command line): the loss
falls and metrics.jsonl is written. ``--device cuda`` is passed only where the parser has it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import gpu_cases as gc

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_train_50_steps_on_one_gpu(tmp_path):
    out = tmp_path / "run"
    cmd = gc.train_command(str(out), steps=50)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES":
           os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = gc.check_metrics((out / "metrics.jsonl").read_text().splitlines(), 50)
    assert '"steps": 50' in proc.stdout, proc.stdout[-2000:]
    print(" ".join(cmd), losses)
