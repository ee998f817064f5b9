"""The 2-D / 3-D Triton ZFP kernels (moeflow.comm.codecs.zfp.triton_nd), run on CPU by Triton's
interpreter, equal the torch back end byte for byte and value for value; and they compile for
an H100 (sm_90), which needs no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_nd_kernels_match_torch_backend_under_interpreter():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", "-m",
                           "tests.zfp_triton_nd_check"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "triton nd kernels match" in proc.stdout


def test_triton_nd_kernels_compile_for_sm90():
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run([sys.executable, "-m", "tests.zfp_triton_nd_check", "--compile"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "triton nd kernels compile" in proc.stdout
