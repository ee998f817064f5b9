"""Runs a Triton kernel check module (``tests/helpers/*_check.py``) in a subprocess: under Triton's CPU
interpreter (``TRITON_INTERPRET=1`` must be set before the kernels are defined, hence the
subprocess), with ``--compile`` to build its kernels for sm_90, which needs no GPU, or with
``--device cuda`` to run the same checks on a GPU: the module's launchers (``LAUNCHERS``) are
wrapped so that their tensors go to the device (strides kept) and their results come back,
and every comparison stays against the CPU torch code, bit for bit."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

#: where the check's kernels run: "cpu" (the interpreter) or "cuda" (``--device cuda``)
DEVICE = "cpu"


def run_check(module: str, expect: str, compile_only: bool = False, timeout: int = 600,
              device: str | None = None) -> None:
    """Run ``python -m tests.helpers.<module>`` and assert it exits 0 and prints ``expect``
    (``device="cuda"``: on the GPU; ``"cpu"``: through the device wrappers, interpreted)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-W", "ignore::RuntimeWarning", "-m", f"tests.helpers.{module}"]
    if compile_only:
        cmd.append("--compile")
    else:
        if device is not None:
            cmd += ["--device", device]
        if device in (None, "cpu"):
            env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert expect in proc.stdout, proc.stdout


def to_device(obj, device: str):
    """Tensors in ``obj`` (nested lists/tuples) on ``device``, each with its strides (a
    strided view stays a strided view); other values as they are."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == torch.device(device).type:
            return obj
        out = torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device=device)
        return out.copy_(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    return obj


@contextlib.contextmanager
def on_device(launchers: list[tuple[object, str]], device: str):
    """Within: each ``(module, name)`` launcher takes its tensor arguments to ``device``,
    asserts its results are there, and returns them on CPU. Yields the call counts."""
    calls = {name: 0 for _, name in launchers}
    saved = [(m, n, getattr(m, n)) for m, n in launchers]

    def wrap(fn, name):
        def run(*args, **kwargs):
            calls[name] += 1
            out = fn(*to_device(args, device),
                     **{k: to_device(v, device) for k, v in kwargs.items()})
            for t in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(t, torch.Tensor):
                    assert t.device.type == torch.device(device).type, (name, t.device)
            return to_device(out, "cpu")
        return run

    for m, n, fn in saved:
        setattr(m, n, wrap(fn, n))
    try:
        yield calls
    finally:
        for m, n, fn in saved:
            setattr(m, n, fn)


def cli(main, compile_sm90, launchers: list[tuple[object, str]] = ()) -> None:
    """Entry point of a check module: ``--compile`` builds for sm_90, ``--device D`` runs the
    checks with ``launchers`` on D (every launcher must be called), otherwise the interpreter
    check runs."""
    global DEVICE
    if "--compile" in sys.argv:
        compile_sm90()
    elif "--device" in sys.argv:
        DEVICE = sys.argv[sys.argv.index("--device") + 1]
        with on_device(list(launchers), DEVICE) as calls:
            main()
        assert all(calls.values()), ("launchers never called", calls)
        print(f"on {DEVICE}: launcher calls {calls}")
    else:
        main()
