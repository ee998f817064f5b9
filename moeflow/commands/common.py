"""Helpers shared by CLI sub-commands: the parser (help shows every default), ``--set
key=value`` overrides, ``--device``, running on ranks (gloo on CPU, ``cpu:gloo,cuda:nccl`` with
``--device cuda``) and reporting failed ranks briefly."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from moeflow.cluster.quota import CpuQuota, parse_cpu_per_rank
from moeflow.cluster.quota import in_force as quota_in_force
from moeflow.config import ConfigError
from moeflow.devices import DEVICES, check_device, check_local_ranks, pg_backend
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
    """``FIELD=VALUE`` strings -> a dict; ``target`` (a dataclass) names the fields and tells
    which take None.

    ``SECTION.FIELD=VALUE`` sets a field of a nested dataclass the target names in its
    ``NESTED`` (``ModelConfig``: ``moe.top_k=1`` sets ``MoEConfig.top_k`` of every MoE block)
    and lands in ``out[SECTION][FIELD]``. A field that is not the target's is refused with a
    ConfigError: one of a section's fields given flat (``top_k=1``) names its one spelling
    (``moe.top_k``); a typo gets a did-you-mean."""
    import dataclasses

    from moeflow.registry import did_you_mean

    def field_types(cls: type) -> dict[str, str]:
        return {f.name: str(f.type) for f in dataclasses.fields(cls)}

    types = field_types(target) if target else {}
    nested = {name: field_types(cls) for name, cls in getattr(target, "NESTED", {}).items()}
    owner = target.__name__ if target else ""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r} is invalid: write FIELD=VALUE, e.g. "
                              "--set n_layers=2, --set moe.top_k=1 or "
                              "--set moe.capacity_factor=none")
        section, dot, field = key.partition(".")
        if dot and target:
            if section not in nested:
                raise ConfigError(f"--set {item!r} is invalid: {owner} has no section "
                                  f"{section!r} (its sections: "
                                  f"{', '.join(s + '.FIELD' for s in nested) or 'none'})"
                                  f"{did_you_mean(section, nested)}")
            if field not in nested[section]:
                raise ConfigError(f"--set {item!r} is invalid: {field!r} is not a field of "
                                  f"{owner}.{section}{did_you_mean(field, nested[section])}")
            out.setdefault(section, {})[field] = parse_value(value,
                                                             "None" in nested[section][field])
            continue
        if target and (key not in types or key in nested):
            raise ConfigError(f"--set {item!r} is invalid: " + _flat_key_fix(key, value, owner,
                                                                             types, nested))
        out[key] = parse_value(value, "None" in types.get(key, "None"))
    return out


def _flat_key_fix(key: str, value: str, owner: str, types: dict, nested: dict) -> str:
    """Why ``--set KEY=VALUE`` is not a field of ``owner``, and the spelling that is."""
    from moeflow.registry import did_you_mean

    if key in nested:
        return f"set the fields of {owner}.{key} one at a time: --set {key}.FIELD=VALUE"
    for section, fields in nested.items():
        if key in fields:
            return (f"{key} is a field of {owner}.{section}: write "
                    f"--set {section}.{key}={value}")
    dotted = [f"{s}.{f}" for s, fields in nested.items() for f in fields]
    hint = did_you_mean(key, [f for f in types if f not in nested]) or did_you_mean(key, dotted)
    return f"{key!r} is not a field of {owner}{hint}"


def run_meta(args: argparse.Namespace | None = None) -> dict:
    """Where and when a benchmark's JSON was made: its command, UTC date, host, CPUs, the load
    average when it was written (the machine is shared: ratios within a run compare, absolute
    times across runs do not), the emulated cluster's links, the CPU quota per rank in force
    (``cpu_per_rank``: cores, or None when the ranks shared the cores; from ``moeflow cluster
    run --cpu-per-rank`` or, given ``args``, the command's own ``--cpu-per-rank``), and the
    moeflow commit when run from a git checkout (None otherwise)."""
    link = {k[len("MOEFLOW_CLUSTER_"):].lower(): float(v) for k, v in os.environ.items()
            if k.startswith("MOEFLOW_CLUSTER_") and k.endswith(("_BPS", "_S"))}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"command": "moeflow " + shlex.join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": platform.node(), "cpus": os.cpu_count(),
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "link": link or None, "cpu_per_rank": cpu_per_rank_record(args),
            "commit": commit or None}


def add_launch_args(p: argparse.ArgumentParser, default_nproc: int) -> None:
    p.add_argument("--nproc", type=int, default=default_nproc,
                   help=f"ranks to start on this machine (default {default_nproc}; with "
                        "--device cuda at most one per GPU); ignored under torchrun, which sets "
                        "the world itself")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds after which a stuck collective fails the job")
    add_quota_arg(p)


def add_quota_arg(p: argparse.ArgumentParser) -> None:
    """``--cpu-per-rank X|auto|none`` for commands that start local ranks."""
    p.add_argument("--cpu-per-rank", default="none", metavar="X",
                   help="GPU-like mode: hold each local rank to X cores (e.g. 0.45) with a CFS "
                        "quota in a CPU cgroup of its own (as root), so a rank with more work "
                        "takes longer as on its own device; auto = 0.9 x cores / ranks; none = "
                        "ranks share the cores (default: none). Under torchrun use `moeflow "
                        "cluster run --cpu-per-rank` instead")


def declared_quota(args: argparse.Namespace | None, nproc: int | None = None) -> float | None:
    """The cores per rank ``args.cpu_per_rank`` asks for (None: none, or no such option),
    ``auto`` resolved for ``nproc`` ranks (default ``args.nproc``)."""
    text = getattr(args, "cpu_per_rank", None)
    if text is None:
        return None
    return parse_cpu_per_rank(text, nproc or getattr(args, "nproc", 1))


def cpu_per_rank_record(args: argparse.Namespace | None = None) -> float | None:
    """The cores per rank in force for a result file (None: the ranks shared the cores): the
    quota ``moeflow cluster run`` gave this rank, else ``args``' own ``--cpu-per-rank``."""
    return quota_in_force(declared_quota(args))


def quota_from_args(args: argparse.Namespace, nproc: int | None = None) -> CpuQuota:
    """The validated :class:`CpuQuota` of ``--cpu-per-rank`` for ``nproc`` local ranks
    (:func:`moeflow.launch.local_quota`)."""
    from moeflow.launch import local_quota

    return local_quota(getattr(args, "cpu_per_rank", None), nproc or getattr(args, "nproc", 1))


def add_device_arg(p: argparse.ArgumentParser, default: str = "cpu") -> None:
    """``--device auto|cpu|cuda``: on CUDA each rank uses ``cuda:LOCAL_RANK``."""
    p.add_argument("--device", default=default, choices=DEVICES,
                   help=f"where the ranks compute (default {default}): cuda puts rank i of a "
                        "node on cuda:LOCAL_RANK and communicates over NCCL (host-side numbers "
                        "over gloo); auto is cuda when a GPU is visible, else cpu")


class RanksFailed(RuntimeError):
    """Ranks started here failed. The message's first line says which and where the full
    tracebacks are; its last line is the first error, prefixed by the rank(s) that raised it."""


def _failure_text(failure) -> str:
    """How a rank without an error file ended (killed by a signal, or exited)."""
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}"
    return f"exited with code {failure.exitcode} without a Python exception"


def rank_errors(err) -> list[tuple[float, int, str, str]]:
    """``(time, rank, "Type: message", traceback)`` of each failed rank, earliest first.

    Read from the error files the elastic launcher has every rank write (its ``@record``) of
    the whole launch, not only the one failure ``ChildFailedError`` carries: when one rank
    raises, the others often fail next (a peer closed the connection), and the error written
    first is the cause. Ranks that wrote none (killed, ``os._exit``) come from ``err``.
    """
    attempts = {Path(f.error_file).parent.parent for f in err.failures.values()
                if f.error_file != "<N/A>"}
    found: dict[int, tuple[float, int, str, str]] = {}
    for attempt in attempts:
        for path in attempt.glob("*/error.json"):
            rank = int(path.parent.name)             # local rank = rank: one node here
            message = json.loads(path.read_text())["message"]
            if isinstance(message, dict):
                text, trace = message["message"], message["extraInfo"]["py_callstack"]
            else:
                text = trace = str(message)
            found[rank] = (path.stat().st_mtime, rank, text, trace)
    for rank, failure in err.failures.items():
        if rank not in found:
            found[rank] = (float(failure.timestamp), rank, _failure_text(failure), "")
    return sorted(found.values())


def describe_failure(errors: list[tuple[float, int, str, str]], where: str) -> str:
    """First line: which ranks failed and where the tracebacks are; last line: the first error
    once, prefixed by every rank that raised the same."""
    first = errors[0][2]
    cause = sorted(r for _, r, text, _ in errors if text == first)
    after = sorted(r for _, r, text, _ in errors if text != first)
    lines = first.strip().splitlines()
    if len(lines) > 3:                               # e.g. one traceback per rank inside
        first = f"{lines[0]} [...] {lines[-1].strip()}"
    ranks = ("rank " if len(cause) == 1 else "ranks ") + ", ".join(map(str, cause))
    then = f" (then rank{'s' if len(after) > 1 else ''} {', '.join(map(str, after))})" \
        if after else ""
    return f"{ranks} failed{then}; full tracebacks: {where}\n{ranks}: {first}"


@contextmanager
def _quiet_launcher():
    """The elastic launcher logs every failed rank's traceback; while it runs here, only its
    critical messages show (the CLI reports failures briefly, see :class:`RanksFailed`)."""
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
               if n.startswith(prefixes)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def run_on_ranks(fn: Callable, args: argparse.Namespace, *fn_args,
                 log_dir: str | None = None, max_restarts: int = 0) -> Any:
    """Run ``fn(*fn_args)`` on every rank; return rank 0's result (None on other ranks, so
    only rank 0 prints and writes files).

    Under torchrun this process is one rank; otherwise ``--nproc`` ranks are started here with
    torch's elastic launcher. The process group is ``cpu:gloo,cuda:nccl`` when the command's
    ``--device`` resolves to cuda, else gloo; a cuda device that is missing (or fewer GPUs than
    local ranks) is an error naming the flag before any rank starts. If ranks fail,
    :class:`RanksFailed` is raised with the first error once; every failed rank's traceback is
    written to ``log_dir/error.log``, and the launcher's per-rank error files stay under
    ``log_dir/logs`` (with no ``log_dir``: in the launcher's temporary folder).
    ``max_restarts``: restarts of all ranks by the elastic agent after a failure (ignored under
    torchrun, whose own ``--max-restarts`` decides).
    """
    device_type = check_device(getattr(args, "device", "cpu"))
    backend = pg_backend(device_type)
    quota = quota_from_args(args)
    if under_torchrun():
        import os

        import torch.distributed as dist

        check_local_ranks(device_type, int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                          "torchrun --nproc-per-node")
        init_from_env(args.timeout, backend)
        result = fn(*fn_args)
        # as launch_local's ranks do: a process group left to the interpreter's exit can
        # abort the rank there ("terminate called without an active exception": gloo's
        # worker threads still joinable when their objects are torn down)
        rank = dist.get_rank()
        dist.destroy_process_group()
        return result if rank == 0 else None
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} is invalid: start at least one rank")
    check_local_ranks(device_type, args.nproc)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        with _quiet_launcher():
            return launch_local(fn, args.nproc, *fn_args, timeout_s=args.timeout,
                                backend=backend, max_restarts=max_restarts, quota=quota,
                                log_dir=None if log_dir is None else str(Path(log_dir) / "logs")
                                )[0]
    except ChildFailedError as err:
        errors = rank_errors(err)
        if log_dir is None:
            where = ", ".join(sorted({str(Path(f.error_file).parent.parent)
                                      for f in err.failures.values()
                                      if f.error_file != "<N/A>"})) or "none recorded"
        else:
            log = Path(log_dir) / "error.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("".join(f"rank {rank}: {text}\n{trace}\n"
                                   for _, rank, text, trace in errors))
            where = str(log)
        raise RanksFailed(describe_failure(errors, where)) from None


def report(res: dict | None, args: argparse.Namespace, format_result) -> int:
    """Print rank 0's result as a table and, with --out, write it as JSON with its command
    and provenance (:func:`run_meta`)."""
    if res is not None:
        print(format_result(res))
        if args.out:
            res.update(run_meta(args))
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
            print(f"wrote {args.out}")
    return 0
