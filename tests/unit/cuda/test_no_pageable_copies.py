"""No pageable host-to-device copy outside setup code (docs/gpu.md, "CUDA-path review, second
read", N4).

``torch.tensor(data, device=cuda)`` / ``torch.as_tensor(data, device=cuda)`` copy host data
from pageable memory: the copy synchronises the stream first, a host wait that the CPU sync
counter (:mod:`moeflow.bench.syncs`, which sees device-to-host reads) cannot see on CPU, where
every tensor is on the host. So the pattern is forbidden in the library by reading its source:
host integers go to the device through :func:`moeflow.devices.to_device_async` (pinned,
non-blocking), a value built on the device is made there (``new_full``, ``torch.full``).
The few remaining uses are listed below with why each is not on the hot path; a new one fails
this test until it is moved to the pinned helper or listed with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import moeflow

ROOT = Path(moeflow.__file__).parent
FACTORIES = ("torch.tensor", "torch.as_tensor")

#: (file under moeflow/, the call's first characters) -> why it may stay
ALLOWED = {
    ("comm/alltoall/blocks.py", "torch.tensor(send_splits"):
        "split_matrix: gathers every rank's splits and reads them back at once (tolist): the "
        "dropless count exchange's one synchronisation, by design",
    ("comm/codecs/zfp/transform.py", "torch.tensor(idx"):
        "pad_index: a handful of indices for zfp's partial blocks (the CPU codec; the CUDA "
        "codec is the Triton kernel)",
    ("comm/exchange.py", "torch.as_tensor(mine"):
        "gather_host_ints on an NCCL-only group (a user's): documented as one synchronisation; "
        "moeflow's own groups carry gloo beside NCCL and take the host path",
    ("comm/sparse.py", "torch.tensor([digest"):
        "the sparse collectives' verify mode (a pre-condition check that reads back at once)",
    ("devices.py", "torch.tensor(values"):
        "host_all_reduce on an NCCL-only group (a user's): documented; gloo groups stay on CPU",
    ("strategies/fssdp/transport.py", "torch.tensor(times"):
        "transport='auto': timing once per layer, at setup",
    ("trainer.py", "torch.as_tensor(m.stat_tensors"):
        "stat_tensors hold device tensors already: as_tensor is a no-op",
    ("pipeline_parallel/stage_model.py", "torch.as_tensor(m.stat_tensors"):
        "stat_tensors hold device tensors already: as_tensor is a no-op",
}


def host_to_device_calls(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` of every ``torch.tensor`` / ``torch.as_tensor`` with a ``device=``
    other than the constant ``"cpu"`` in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in FACTORIES:
            dev = [k.value for k in node.keywords if k.arg == "device"]
            if dev and not (isinstance(dev[0], ast.Constant) and dev[0].value == "cpu"):
                out.append((node.lineno, ast.unparse(node)))
    return out


def test_the_scanner_finds_the_pattern():
    src = ("import torch\nx = torch.tensor([T], device=dev)\n"
           "y = torch.as_tensor(a, dtype=torch.long, device=send.device)\n"
           "z = torch.tensor([1], device='cpu')\nw = torch.tensor([1])\n")
    assert [line for line, _ in host_to_device_calls(src)] == [2, 3]


def test_no_pageable_host_to_device_copy_outside_the_listed_setup_code():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("bench/"):         # benchmarks time setups, not the training path
            continue
        for line, call in host_to_device_calls(path.read_text()):
            key = next((k for k in ALLOWED if k[0] == rel and call.startswith(k[1])), None)
            if key is None:
                found[f"moeflow/{rel}:{line}"] = call
            else:
                found.setdefault(key, None)
    bad = {k: v for k, v in found.items() if isinstance(k, str)}
    assert not bad, ("pageable host-to-device copies (use moeflow.devices.to_device_async, or "
                     f"build the value on the device): {bad}")
    stale = [k for k in ALLOWED if k not in found]
    assert not stale, f"listed but gone (drop them from ALLOWED): {stale}"
