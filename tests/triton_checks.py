"""Runs a Triton kernel check module (``tests/*_check.py``) in a subprocess: under Triton's CPU
interpreter (``TRITON_INTERPRET=1`` must be set before the kernels are defined, hence the
subprocess), or with ``--compile`` to build its kernels for sm_90, which needs no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_check(module: str, expect: str, compile_only: bool = False, timeout: int = 600) -> None:
    """Run ``python -m tests.<module>`` and assert it exits 0 and prints ``expect``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-W", "ignore::RuntimeWarning", "-m", f"tests.{module}"]
    if compile_only:
        cmd.append("--compile")
    else:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert expect in proc.stdout, proc.stdout


def cli(main, compile_sm90) -> None:
    """Entry point of a check module: ``--compile`` builds for sm_90, otherwise the interpreter
    check runs."""
    if "--compile" in sys.argv:
        compile_sm90()
    else:
        main()
