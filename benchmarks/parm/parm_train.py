"""Parm's Table V analog: ``moeflow train`` step time per MP / ESP layout and schedule on an
emulated cluster (docs/benchmarks/parm.md, "Training step time (Table V analog)").

Each variant ``mp{N}-esp{N}[:schedule]`` (``mp1-esp1`` is pure data + expert parallelism) is a
real ``moeflow train`` job started by ``moeflow cluster run`` on ``--nodes`` x
``--ranks-per-node`` emulated nodes. The variants run interleaved, ``--reps`` rounds of one job
each, so that slow phases of a shared machine hit them alike. Every variant trains the same
``--global-batch`` sequences per step (``--batch-size`` of a job = global batch / data-parallel
ranks, and an MP group shares one batch), so step times compare equal work. A job's step time
is the median of
its per-step times (``elapsed_s`` differences of consecutive ``metrics.jsonl`` records, logged
every step) after ``--warmup`` steps; a variant's is the median over its jobs, and the ratio is
against the first variant. Run as root::

    moeflow bench parm-train --out docs/results/parm/parm-train-2x2-1gbit.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moeflow.cluster.quota import parse_cpu_per_rank


def parse_variant(text: str) -> tuple[int, int, str]:
    """``mp2-esp2:baseline`` -> (2, 2, "baseline"); the schedule defaults to baseline."""
    layout, _, schedule = text.partition(":")
    try:
        mp, esp = (int(part[len(name):]) for part, name in zip(layout.split("-"),
                                                                 ("mp", "esp"), strict=True))
    except ValueError:
        raise SystemExit(f"--variants: {text!r} is invalid; write mp<N>-esp<N>[:schedule], "
                         "e.g. mp1-esp1 or mp2-esp2:baseline") from None
    return mp, esp, schedule or "baseline"


def step_times(metrics: Path, warmup: int) -> list[float]:
    """Per-step seconds of a run logged every step, after ``warmup`` steps."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    recs = [r for r in recs if "elapsed_s" in r]
    times = [(b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"])
             for a, b in zip(recs, recs[1:])]
    return times[max(0, warmup - 1):]


def run_job(args: argparse.Namespace, variant: str, out: Path) -> dict:
    mp, esp, schedule = parse_variant(variant)
    dp = args.nodes * args.ranks_per_node // mp
    if args.global_batch % dp:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over the {dp} "
                         f"data-parallel ranks of {variant}; use a multiple of {dp}")
    train = [sys.executable, "-m", "moeflow.cli", "train", "--preset", args.preset,
             "--steps", str(args.steps), "--batch-size", str(args.global_batch // dp),
             "--log-every", "1", "--eval-every", str(10 * args.steps), "--eval-batches", "1",
             "--warmup-steps", "0", "--mp", str(mp), "--esp", str(esp),
             "--set", f"moe.parallel_schedule={schedule}", "--out", str(out), "--no-progress",
             *sum((["--set", s] for s in args.set), [])]
    cmd = [sys.executable, "-m", "moeflow.cli", "cluster", "run", "--nodes", str(args.nodes),
           "--ranks-per-node", str(args.ranks_per_node), "--inter-bw", args.inter_bw,
           "--cpu-per-rank", args.cpu_per_rank, "--",
           *train]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.job_timeout)
    if done.returncode:
        raise SystemExit(f"{variant}: the job failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    times = step_times(out / "metrics.jsonl", args.warmup)
    return {"variant": variant, "step_s": statistics.median(times), "step_times_s": times,
            "job_wall_s": time.perf_counter() - start}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default="mp1-esp1,mp2-esp2:baseline",
                   help="comma-separated mp<N>-esp<N>[:schedule]; the first is the reference")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    p.add_argument("--ranks-per-node", type=int, default=2,
                   help="ranks per emulated node")
    p.add_argument("--inter-bw", default="1gbit",
                   help="inter-node link rate (tc syntax)")
    p.add_argument("--cpu-per-rank", default="none", metavar="X",
                   help="passed to moeflow cluster run: cores per rank (GPU-like mode), auto "
                        "or none (default: none, shared cores)")
    p.add_argument("--preset", default="tiny", help="moeflow train --preset")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=V",
                   help="model overrides passed to moeflow train")
    p.add_argument("--global-batch", type=int, default=32,
                   help="sequences per step over all data-parallel ranks")
    p.add_argument("--steps", type=int, default=12, help="steps per job")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of each job's median")
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds (one job each)")
    p.add_argument("--job-timeout", type=float, default=600.0,
                   help="seconds one job may take")
    p.add_argument("--out", required=True, help="JSON results")


def run(args: argparse.Namespace, command: str) -> int:
    """Run the variants interleaved and write ``args.out``; ``command`` is recorded."""
    variants = args.variants.split(",")
    for v in variants:
        parse_variant(v)
    jobs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for i, v in enumerate(variants):
                job = run_job(args, v, Path(tmp) / f"r{rep}-v{i}")
                jobs.append({"rep": rep, **job})
                print(f"rep {rep} {v}: {1e3 * job['step_s']:.1f} ms/step", flush=True)
    summary = {}
    for v in variants:
        meds = [j["step_s"] for j in jobs if j["variant"] == v]
        summary[v] = {"median_step_s": statistics.median(meds), "job_medians_s": meds}
    ref = summary[variants[0]]["median_step_s"]
    for v in variants:
        summary[v]["ratio_to_first"] = summary[v]["median_step_s"] / ref
    result = {"command": command,
              "world": args.nodes * args.ranks_per_node, "inter_bw": args.inter_bw,
              "cpu_per_rank": parse_cpu_per_rank(args.cpu_per_rank,
                                                 args.nodes * args.ranks_per_node),
              "preset": args.preset, "overrides": args.set,
              "global_batch": args.global_batch,
              "steps": args.steps, "warmup": args.warmup, "summary": summary, "jobs": jobs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'variant':<24}{'ms/step':>10}{'ratio':>8}")
    for v in variants:
        s = summary[v]
        print(f"{v:<24}{1e3 * s['median_step_s']:>10.1f}{s['ratio_to_first']:>8.2f}")
    return 0
