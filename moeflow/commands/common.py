"""Helpers shared by CLI sub-commands: the parser (help shows every default), ``--set
key=value`` overrides, running on ranks."""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from moeflow.config import ConfigError
from moeflow.launch import init_from_env, launch_local, under_torchrun


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; each option's help ends with its default, unless the help
    already says what the default is (``(default: cores / ranks)``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "default" in text.lower() else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """``moeflow``'s parser: :class:`HelpFormatter` unless told otherwise, and sub-parsers
    (``add_subparsers`` makes them of the parent's class) inherit it."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


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
                   help="CPU ranks to start on this machine; ignored under torchrun, which sets "
                        "the world itself")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds after which a stuck collective fails the job")


def run_on_ranks(fn: Callable, args: argparse.Namespace, *fn_args) -> Any:
    """Run ``fn(*fn_args)`` on every rank; return rank 0's result (None on other ranks, so
    only rank 0 prints and writes files).

    Under torchrun this process is one rank (NCCL on GPUs, gloo on CPU); otherwise
    ``--nproc`` gloo ranks are started here with torch's elastic launcher.
    """
    if under_torchrun():
        import torch.distributed as dist

        init_from_env(args.timeout)
        result = fn(*fn_args)
        return result if dist.get_rank() == 0 else None
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} is invalid: start at least one rank")
    return launch_local(fn, args.nproc, *fn_args, timeout_s=args.timeout)[0]
