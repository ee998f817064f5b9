"""Activation recomputation of ``moeflow train`` measured: memory and step time of
``--recompute none / full / moe_act`` (docs/benchmarks/training.md).

Each (mode, repetition) is a fresh launch of ``nproc`` gloo ranks (peak RSS only grows within a
process), modes interleaved within each repetition. Every rank builds the Trainer of the preset,
records its resident set size (``/proc/self/statm``) before the first step, runs ``warmup``
steps and ``steps`` timed ones (``Trainer.train_step``, ranks aligned by a barrier before
each), and reports its step times and its peak RSS (``getrusage``'s ``ru_maxrss``) minus the
RSS before the first step: the memory the training steps added at their peak (activations,
gradients, AdamW's state, allocator slack). The slowest rank's time counts for a step.
Ratios over ``none`` are taken within each repetition (the modes ran side by side there): the
mode's median step time over ``none``'s, its peak memory added over ``none``'s; the summary
gives their min / median / max over the repetitions.

    moeflow bench recompute --out docs/results/training/recompute-small-2rank.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile

import torch

from benchmarks.training.train_steps import timed_steps

MODES = ("none", "full", "moe_act")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_worker(preset: str, mode: str, batch_size: int, warmup: int, steps: int,
                out_dir: str) -> dict:
    from moeflow.config import TrainConfig, model_preset
    from moeflow.topology import Topology
    from moeflow.trainer import Trainer

    mcfg = model_preset(preset)
    tcfg = TrainConfig(steps=warmup + steps, batch_size=batch_size, recompute=mode,
                       warmup_steps=0)
    trainer = Trainer(mcfg, tcfg, out_dir, Topology.from_env(), progress=False)
    before = _rss_bytes()
    times = timed_steps(trainer, warmup, steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # KiB on Linux
    return {"times": times, "peak_added_bytes": peak - before, "rss_before": before}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from moeflow.commands.common import add_quota_arg

    p.add_argument("--preset", default="small", help="model preset (default small)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--repeats", type=int, default=3,
                   help="launches per mode, the modes interleaved within each (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per launch")
    p.add_argument("--steps", type=int, default=3, help="timed steps per launch")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (with --cpu-per-rank: ceil of it)")
    add_quota_arg(p)
    p.add_argument("--out", default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> dict:
    from moeflow.commands.common import quota_from_args
    from moeflow.launch import launch_local

    quota = quota_from_args(args)

    runs = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode in MODES:
                res = launch_local(rank_worker, args.nproc, args.preset, mode, args.batch_size,
                                   args.warmup, args.steps, tmp, timeout_s=600,
                                   threads=args.threads, quota=quota)
                step = [max(r["times"][i] for r in res.values())
                        for i in range(args.steps)]
                peak = max(r["peak_added_bytes"] for r in res.values())
                runs[mode].append({"repeat": rep, "step_s": step, "peak_added_bytes": peak})
                print(f"repeat {rep} {mode:8s} step {statistics.median(step):.3f} s, "
                      f"peak added {peak / 2**20:.0f} MiB", flush=True)
    summary = {}
    for mode, rs in runs.items():
        steps = [t for r in rs for t in r["step_s"]]
        peaks = [r["peak_added_bytes"] / 2**20 for r in rs]
        summary[mode] = {"step_s_median": statistics.median(steps), "step_s_min": min(steps),
                         "step_s_max": max(steps),
                         "peak_added_mib_median": statistics.median(peaks),
                         "peak_added_mib_min": min(peaks), "peak_added_mib_max": max(peaks)}
    for mode, rs in runs.items():              # ratios over none, within each repetition
        time_r = [statistics.median(r["step_s"]) / statistics.median(n["step_s"])
                  for r, n in zip(rs, runs["none"])]
        mem_r = [r["peak_added_bytes"] / n["peak_added_bytes"]
                 for r, n in zip(rs, runs["none"])]
        summary[mode].update({f"{what}_over_none_{stat}": fn(vals)
                              for what, vals in (("step", time_r), ("memory", mem_r))
                              for stat, fn in (("min", min), ("median", statistics.median),
                                               ("max", max))})
    # the CLI's parsed arguments carry its handler: keep the options only
    options = {k: v for k, v in vars(args).items() if not callable(v)}
    out = {"args": options, "torch": torch.__version__, "load_avg_end": os.getloadavg(),
           "cpu_per_rank": quota.cpu_per_rank,
           "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out
