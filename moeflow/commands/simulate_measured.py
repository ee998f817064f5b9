"""The measured twin of ``moeflow simulate train``: a ``moeflow train --out RUN_DIR`` run's step
times, and the check that the prediction describes that run.

``moeflow train`` writes ``RUN_DIR/config.json`` (the model config as given, the
``TrainConfig``, the world size and the ranks per node) and, on rank 0, ``RUN_DIR/metrics.jsonl``:
one record per log point with ``tokens_per_s`` over the steps since the previous log point
(:meth:`moeflow.trainer.Trainer._loop`: the clock restarts after each log point's evaluation, so
validation is not in it; a checkpoint written at a log point is, in the next interval's). A
record's mean step time is ``tokens per step / tokens_per_s`` with ``tokens per step =
dp_size x batch_size x grad_accum x seq_len`` (the trainer's own count). The first steps carry
one-time work (the replica check of the first gradient sync, first-call allocations), so the
records whose interval starts before step ``skip`` are left out; the rest give the median and
the spread (min / max) the prediction is compared against (ScheMoE Section 4.2 checks its task
models the same way: predicted next to measured).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from moeflow.config import ModelConfig, TrainConfig, config_differences
from moeflow.errors import ConfigError


def run_files(path: str | Path) -> tuple[Path, Path]:
    """``(config.json, metrics.jsonl)`` of a run folder, or of a metrics file (its folder's
    config.json beside it)."""
    p = Path(path)
    metrics = p / "metrics.jsonl" if p.is_dir() else p
    config = metrics.parent / "config.json"
    for f, what in ((metrics, "metrics.jsonl"), (config, "config.json")):
        if not f.is_file():
            raise ConfigError(f"--measured {path}: no {what} at {f} (give the folder of "
                              "`moeflow train --out RUN_DIR`, or its metrics.jsonl with the "
                              "run's config.json beside it)")
    return config, metrics


def step_times(records: list[dict], tokens_per_step: int, skip: int) -> list[dict]:
    """Per training log record (``tokens_per_s`` present, no ``event``), the steps it covers
    and their mean step time; records whose interval starts before step ``skip`` (warm-up)
    are left out."""
    out, prev = [], 0
    for r in records:
        if "event" in r or "step" not in r:
            continue
        if "tokens_per_s" in r:
            if prev >= skip and r["tokens_per_s"] > 0:
                out.append({"first_step": prev + 1, "last_step": r["step"],
                            "step_s": tokens_per_step / r["tokens_per_s"]})
        prev = r["step"]
    return out


def summarize(times: list[dict]) -> dict:
    """Median and spread (min / max) of the records' step times; ``n``: records."""
    v = [t["step_s"] for t in times]
    return {"n": len(v), "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
            "steps": [times[0]["first_step"], times[-1]["last_step"]]}


def check_same_run(saved: dict, model: ModelConfig, train: dict, world: int,
                   ranks_per_node: int) -> None:
    """Raise ``ConfigError`` naming the first field where the run's ``config.json`` (``saved``)
    and this command's arguments describe different runs: the model config (fields the run
    predates count as their defaults, as ``--resume`` reads them), the ``TrainConfig`` fields
    in ``train`` (name -> this command's value), the world size and the ranks per node (runs
    recorded before the ranks per node was written are checked on the world only)."""
    if not isinstance(saved.get("model"), dict) or not isinstance(saved.get("train"), dict):
        raise ConfigError("--measured: the run's config.json has no 'model' / 'train' entries "
                          "(is it a `moeflow train --out` folder?)")
    theirs = ModelConfig.from_dict(saved["model"], "--measured: the run's config.json")
    for name, (run, value) in config_differences(theirs, model).items():
        raise ConfigError(f"--measured: ModelConfig.{name} differs: the run has "
                          f"{run!r}, this command {value!r}; give the run's "
                          f"--preset / --set (e.g. --set {name}={run})")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for name, value in train.items():
        run = saved["train"].get(name, defaults.get(name))
        if run != value:
            raise ConfigError(f"--measured: TrainConfig.{name} differs: the run has {run!r}, "
                              f"this command {value!r}; give {TrainConfig.flag(name)} as the "
                              "run did")
    if saved.get("world_size") != world:
        raise ConfigError(f"--measured: world_size differs: the run had "
                          f"{saved.get('world_size')!r} ranks, this command {world} (--nproc, "
                          "or --nodes x --ranks-per-node)")
    local = saved.get("local_size")
    if local is not None and local != ranks_per_node:
        raise ConfigError(f"--measured: local_size (ranks per node) differs: the run had "
                          f"{local}, this command {ranks_per_node} (--nodes / "
                          "--ranks-per-node as the run's cluster)")


def check_modelled(saved: dict) -> None:
    """Refuse runs whose settings the step model does not cover: FSDP2 on the dense part,
    bf16 autocast (the model moves fp32), a CUDA run is fine (``--device cuda``)."""
    t = saved["train"]
    if t.get("dense_shard", "replicate") != "replicate":
        raise ConfigError(f"--measured: TrainConfig.dense_shard={t['dense_shard']!r}: FSDP2 on "
                          "the dense part is not modelled; measure a run with --dense-shard "
                          "replicate")
    dtype, device = t.get("dtype", "auto"), t.get("device", "auto")
    if dtype == "bf16" or (dtype == "auto" and device == "cuda"):
        raise ConfigError(f"--measured: TrainConfig.dtype={dtype!r} (device {device!r}) runs "
                          "under bf16 autocast, and the step model counts fp32 bytes; measure "
                          "a run with --dtype fp32")


def measured_twin(path: str | Path, model: ModelConfig, train: dict, world: int,
                  ranks_per_node: int, device: str, skip: int) -> dict:
    """The run at ``path`` checked against this command's arguments, and its step times."""
    config, metrics = run_files(path)
    saved = json.loads(config.read_text())
    check_modelled(saved)
    check_same_run(saved, model, train, world, ranks_per_node)
    run_device = saved["train"].get("device", "auto")
    if run_device != "auto" and run_device != device:
        raise ConfigError(f"--measured: TrainConfig.device differs: the run has "
                          f"{run_device!r}, this command {device!r}; give --device "
                          f"{run_device}")
    t = saved["train"]
    dp = world // t.get("mp_size", 1)
    tokens = dp * t["batch_size"] * t.get("grad_accum", 1) * model.seq_len
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = step_times(records, tokens, skip)
    if not times:
        raise ConfigError(f"--measured {path}: no logged step after the first {skip} (warm-up, "
                          "--skip-steps); train more --steps, with --log-every 1 for one "
                          "record per step")
    return {"run": str(path), "skip_steps": skip, "tokens_per_step": tokens,
            "records": times, **summarize(times)}


__all__ = ["check_modelled", "check_same_run", "measured_twin", "run_files", "step_times",
           "summarize"]
