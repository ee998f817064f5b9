"""``moeflow bench hecate-fit`` and ``moeflow bench hecate-model``: HECATE on a whole GPT of
several MoE layers under skewed loads -- peak memory per rank and the largest batch under a
budget (:mod:`moeflow.bench.hecate_fit`), and interleaved step times with the chosen ``P'``
(:mod:`moeflow.bench.hecate_model`)."""

from __future__ import annotations

import argparse
import shlex
import sys

from moeflow.commands.common import add_launch_args, report, run_on_ranks

FIT_MODES = ["ep", "fssdp:t=2,m=2", "fssdp:t=2,m=2,rm"]
TIME_MODES = ["ep", "fssdp:t=2,m=2", "fssdp:t=4,budget=1M", "fssdp:t=4,budget=1M,cal"]


def _model_args(p: argparse.ArgumentParser, modes: list[str]) -> None:
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=V",
                   help="override a ModelConfig field of the preset (repeatable), e.g. "
                        "n_layers=4, moe_every=1, moe.num_experts=16")
    p.add_argument("--modes", nargs="+", default=modes,
                   help="ep | fssdp:static | fssdp:t=T,m=M | fssdp:t=T,budget=BYTES (k/M "
                        f"suffix), each optionally ,cal ,rm (default {' '.join(modes)})")
    p.add_argument("--zipf", type=float, default=1.0,
                   help="router skew s: expert e favoured by rank_e^-s (default 1)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def register_bench(bsub) -> None:
    from moeflow.bench import hecate_fit

    p = bsub.add_parser("hecate-fit", help="HECATE Fig. 13/14 analog: peak memory per rank of "
                                           "a GPT training step under EP / FSSDP / FSSDP-RM "
                                           "and the largest batch each fits in a budget",
                        description=hecate_fit.__doc__.split("\n\n")[0])
    _model_args(p, FIT_MODES)
    p.add_argument("--budget-mib", type=float, required=True,
                   help="per-rank budget: MiB of resident memory a training step may add "
                        "above the process before the model (the largest rank counts)")
    p.add_argument("--start-batch", type=int, default=1, help="first batch of the search")
    p.add_argument("--max-batch", type=int, default=256, help="largest batch tried")
    p.add_argument("--warmup", type=int, default=3, help="steps before the search")
    p.add_argument("--probe-steps", type=int, default=2,
                   help="steps per probed batch size, the last measured (default 2)")
    p.add_argument("--nproc", type=int, default=4, help="ranks per launch (default 4)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.set_defaults(func=run_fit)

    q = bsub.add_parser("hecate-model", help="HECATE on a GPT of several MoE layers: EP and "
                                             "FSSDP modes interleaved, step time, loads, P'")
    _model_args(q, TIME_MODES)
    q.add_argument("--batch", type=int, default=8, help="sequences per rank (default 8)")
    q.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    q.add_argument("--reps", type=int, default=5, help="timed rounds")
    add_launch_args(q, default_nproc=4)
    q.set_defaults(func=run_time)


def _opts(args: argparse.Namespace, name: str) -> dict:
    from moeflow.bench.hecate_model import parse_mode
    from moeflow.commands.common import parse_overrides
    from moeflow.config import ModelConfig

    for m in args.modes:
        try:
            parse_mode(m)
        except ValueError as err:
            raise SystemExit(f"moeflow bench {name}: --modes: {err}")
    return {"preset": args.preset, "overrides": parse_overrides(args.overrides, ModelConfig),
            "modes": list(args.modes), "zipf": args.zipf, "warmup": args.warmup,
            "command": "moeflow " + shlex.join(sys.argv[1:])}


def run_fit(args: argparse.Namespace) -> int:
    from moeflow.bench import hecate_fit

    for name in ("start_batch", "max_batch", "probe_steps", "nproc"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench hecate-fit: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    if args.budget_mib <= 0:
        raise SystemExit(f"moeflow bench hecate-fit: --budget-mib {args.budget_mib} must be > 0")
    opts = {**_opts(args, "hecate-fit"), "budget": int(args.budget_mib * 2**20),
            "start_batch": args.start_batch, "max_batch": args.max_batch,
            "probe_steps": args.probe_steps}
    return report(hecate_fit.run(opts, args.nproc, args.timeout), args,
                  hecate_fit.format_result)


def run_time(args: argparse.Namespace) -> int:
    from moeflow.bench.hecate_model import format_time, time_worker

    for name in ("batch", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench hecate-model: --{name} {getattr(args, name)} "
                             "must be >= 1")
    opts = {**_opts(args, "hecate-model"), "batch": args.batch, "reps": args.reps}
    return report(run_on_ranks(time_worker, args, opts), args, format_time)
