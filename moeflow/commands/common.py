"""Helpers shared by CLI sub-commands: ``--set key=value`` overrides, ``--device``, running on
ranks (gloo on CPU, ``cpu:gloo,cuda:nccl`` with ``--device cuda``)."""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from moeflow.config import ConfigError
from moeflow.devices import DEVICES, check_device, check_local_ranks, pg_backend
from moeflow.launch import init_from_env, launch_local, under_torchrun


def parse_value(text: str, nullable: bool = True) -> Any:
    """JSON numbers/booleans as such; ``none``/``null`` -> None where the field accepts None
    (``capacity_factor=none``: dropless), else the string (``codec=none``: the no-op codec);
    anything else a string."""
    if text.lower() in ("none", "null"):
        return None if nullable else text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_overrides(items: list[str], target: type | None = None) -> dict[str, Any]:
    """``FIELD=VALUE`` strings -> a dict; ``target`` (a dataclass) tells which fields take None."""
    import dataclasses

    types = {f.name: str(f.type) for f in dataclasses.fields(target)} if target else {}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r} is invalid: write FIELD=VALUE, e.g. "
                              "--set num_experts=16 or --set capacity_factor=none")
        key = key.strip()
        out[key] = parse_value(value.strip(), "None" in types.get(key, "None"))
    return out


def add_launch_args(p: argparse.ArgumentParser, default_nproc: int) -> None:
    p.add_argument("--nproc", type=int, default=default_nproc,
                   help=f"ranks to start on this machine (default {default_nproc}; with "
                        "--device cuda at most one per GPU); ignored under torchrun, which sets "
                        "the world itself")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds after which a stuck collective fails the job (default 300)")


def add_device_arg(p: argparse.ArgumentParser, default: str = "cpu") -> None:
    """``--device auto|cpu|cuda``: on CUDA each rank uses ``cuda:LOCAL_RANK``."""
    p.add_argument("--device", default=default, choices=DEVICES,
                   help=f"where the ranks compute (default {default}): cuda puts rank i of a "
                        "node on cuda:LOCAL_RANK and communicates over NCCL (host-side numbers "
                        "over gloo); auto is cuda when a GPU is visible, else cpu")


def run_on_ranks(fn: Callable, args: argparse.Namespace, *fn_args) -> Any:
    """Run ``fn(*fn_args)`` on every rank; return rank 0's result (None on other ranks, so
    only rank 0 prints and writes files).

    Under torchrun this process is one rank; otherwise ``--nproc`` ranks are started here with
    torch's elastic launcher. The process group is ``cpu:gloo,cuda:nccl`` when the command's
    ``--device`` resolves to cuda, else gloo; a cuda device that is missing (or fewer GPUs than
    local ranks) is an error naming the flag before any rank starts.
    """
    device_type = check_device(getattr(args, "device", "cpu"))
    backend = pg_backend(device_type)
    if under_torchrun():
        import os

        import torch.distributed as dist

        check_local_ranks(device_type, int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                          "torchrun --nproc-per-node")
        init_from_env(args.timeout, backend)
        result = fn(*fn_args)
        return result if dist.get_rank() == 0 else None
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} is invalid: start at least one rank")
    check_local_ranks(device_type, args.nproc)
    return launch_local(fn, args.nproc, *fn_args, timeout_s=args.timeout, backend=backend)[0]
