"""``moeflow bench pipeline``: the options of the pipeline-parallelism benchmark
(:mod:`moeflow.bench.pipeline_bench`), checked before any rank starts."""

from __future__ import annotations

import argparse
import os

from moeflow.commands.common import (add_device_arg, add_launch_args, parse_overrides, report,
                                     run_on_ranks)

DEFAULT_CONFIGS = ("ep,pp2:gpipe,pp2:1f1b,pp2:interleaved-1f1b,pp2:zbv,pp2:dualpipev,"
                   "pp2:dualpipev:overlap=off")


def register_bench(bsub) -> None:
    from moeflow.bench import pipeline_bench
    from moeflow.config import PRESETS

    p = bsub.add_parser("pipeline", help="EP vs PP x EP training steps: tokens/s, memory per "
                                         "rank, measured vs theoretical bubble, exposed "
                                         "all-to-all (one launch, interleaved rounds)",
                        description=pipeline_bench.__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma-separated configurations: ep (expert parallelism over every "
                        "rank) or pp<N>:<schedule>[:<layout>][:overlap=<o>] with layout "
                        "across-nodes (default) or within-nodes, o auto (default), on or off "
                        f"(--pp-overlap) (default {DEFAULT_CONFIGS})")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=V",
                   help="override a ModelConfig field or moe.FIELD, as in moeflow train")
    p.add_argument("--global-batch", type=int, default=16,
                   help="sequences per optimizer step, the same for every configuration "
                        "(ep: global-batch / ranks per rank; a pipeline: --micro-batches "
                        "micro-batches per stage position)")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="the pipeline's micro-batches per step (--grad-accum of moeflow train)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration")
    p.add_argument("--reps", type=int, default=3,
                   help="rounds of one timed step per configuration, interleaved")
    add_device_arg(p)
    p.add_argument("--out", default=None, help="write every sample as JSON here")
    add_launch_args(p, default_nproc=4)
    p.set_defaults(func=run_pipeline)


def bench_configs(args: argparse.Namespace, world: int, local: int):
    """The model config and the configurations; ``ConfigError`` naming the flag otherwise."""
    from moeflow.bench.pipeline_cases import case_train_config, parse_cases
    from moeflow.commands.train_command import check_layout
    from moeflow.config import ModelConfig, model_preset
    from moeflow.errors import ConfigError

    for name in ("global_batch", "micro_batches", "reps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: "
                              "it must be >= 1")
    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup} is invalid: it must be >= 0")
    out_dir = os.path.dirname(args.out or "") or "."
    if args.out and not os.path.isdir(out_dir):     # checked before minutes of steps
        raise ConfigError(f"--out {args.out}: the folder {out_dir!r} does not exist; create it "
                          f"(mkdir -p {out_dir}) or write elsewhere")
    mcfg = model_preset(args.preset, **parse_overrides(args.overrides, ModelConfig))
    cases = parse_cases(args.configs)
    for case in cases:
        tcfg = case_train_config(case, world, args.global_batch, args.micro_batches, 1)
        check_layout(mcfg, tcfg, world, local)
    return mcfg, cases


def run_pipeline(args: argparse.Namespace) -> int:
    from moeflow.bench.pipeline_bench import bench_worker, format_table
    from moeflow.launch import under_torchrun

    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun() else world
    mcfg, cases = bench_configs(args, world, local)
    res = run_on_ranks(bench_worker, args, cases, mcfg, args.global_batch, args.micro_batches,
                       args.warmup, args.reps, args.device)
    return report(res, args, format_table)
