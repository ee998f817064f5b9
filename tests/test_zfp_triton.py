"""The Triton ZFP kernels, run on CPU by Triton's interpreter, equal the torch back end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_kernels_match_torch_backend_under_interpreter():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "tests.zfp_triton_check"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "triton kernels match" in proc.stdout
