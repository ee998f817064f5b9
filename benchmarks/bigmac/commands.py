"""``moeflow bench bigmac``: structures side by side (see :mod:`benchmarks.bigmac.bigmac`); and
``moeflow bench curves``: validation loss of train runs vs steps and time (BigMac Fig. 1)."""

from __future__ import annotations

import argparse
import shlex
import sys

from moeflow.commands.common import (add_device_arg, add_launch_args, cpu_per_rank_record,
                                     run_on_ranks)
from moeflow.config import STRUCTURES
from moeflow.registry import did_you_mean


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def add_bigmac_args(p: argparse.ArgumentParser) -> None:
    """``bench bigmac``'s arguments (``moeflow simulate bigmac`` takes the same ones, so every
    predicted row has a measured twin)."""
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=512, help="model width (d_model)")
    p.add_argument("--d-expert", type=int, default=128,
                   help="fine-grained expert width F (BigMac experts: F/r)")
    p.add_argument("--num-experts", type=int, default=16, help="fine-grained experts E")
    p.add_argument("--top-k", type=_int_list, default=[4, 8],
                   help="experts per token, a comma list: one row per value (default 4,8)")
    p.add_argument("--downscale-factor", type=float, default=0.25, help="BigMac's r")
    p.add_argument("--structures", default="fine_grained,bigmac",
                   help=f"comma list from {','.join(STRUCTURES)}")
    p.add_argument("--granularity", type=int, default=4,
                   help="vanilla row: E/g experts of width F*g, top k/g")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--reps", type=int, default=5, help="timed steps")
    add_device_arg(p)
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op CPU threads per rank (default: cores / ranks); 1 makes the "
                        "CPU-time column robust on a shared machine")
    p.add_argument("--out", default=None,
                   help="write the results as JSON here (default: print only)")
    add_launch_args(p, default_nproc=1)


def bigmac_cases(args: argparse.Namespace, command: str) -> list:
    """The checked arguments' cases (:func:`benchmarks.bigmac.bigmac.default_cases`)."""
    from benchmarks.bigmac.bigmac import default_cases

    for name in ("tokens", "d_model", "d_expert", "num_experts", "reps", "granularity"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow {command}: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    structures = [s for s in args.structures.split(",") if s]
    bad = [s for s in structures if s not in STRUCTURES]
    if bad or not structures:
        raise SystemExit(f"moeflow {command}: --structures {args.structures!r}: choose from "
                         f"{', '.join(STRUCTURES)}"
                         f"{did_you_mean(bad[0], STRUCTURES) if bad else ''}")
    return default_cases(args.num_experts, args.d_expert, args.top_k, args.downscale_factor,
                         structures, args.granularity)


def register_bench(bsub) -> None:
    p = bsub.add_parser("bigmac", help="fine-grained vs BigMac MoE layer: step time, phases, "
                                       "all-to-all bytes counted vs computed")
    add_bigmac_args(p)
    p.set_defaults(func=run_bigmac)

    c = bsub.add_parser("curves", help="validation loss of train runs vs steps and wall clock")
    c.add_argument("runs", nargs="+", help="moeflow train run folders (--out of each)")
    c.add_argument("--labels", default=None, help="comma list (default: each run's structure)")
    c.add_argument("--out", default=None,
                   help="write the curves as JSON here (default: print only)")
    c.add_argument("--plot", default=None,
                   help="write a PNG here (needs matplotlib: pip install 'moeflow[plot]'; "
                        "default: no plot)")
    c.set_defaults(func=run_curves)


def run_bigmac(args: argparse.Namespace) -> int:
    from moeflow.devices import check_device

    check_device(args.device)            # fail fast, before the bench registers "counting"
    from benchmarks.bigmac.bigmac import bench_worker, format_table, write_json

    cases = bigmac_cases(args, "bench bigmac")
    rows = run_on_ranks(bench_worker, args, cases, args.tokens, args.d_model, args.warmup,
                        args.reps, args.device, args.threads)
    if rows is not None:
        print(format_table(rows))
        if args.out:
            write_json(rows, args.out, "moeflow " + shlex.join(sys.argv[1:]),
                       cpu_per_rank_record(args))
            print(f"wrote {args.out}")
    return 0


def run_curves(args: argparse.Namespace) -> int:
    import json

    from moeflow.bench.curves import format_table, load_run, plot

    labels = args.labels.split(",") if args.labels else [None] * len(args.runs)
    if len(labels) != len(args.runs):
        raise SystemExit(f"moeflow bench curves: --labels has {len(labels)} names for "
                         f"{len(args.runs)} runs")
    runs = [load_run(r, lab) for r, lab in zip(args.runs, labels)]
    print(format_table(runs))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "moeflow " + shlex.join(sys.argv[1:]), "runs": runs}, f,
                      indent=2)
        print(f"wrote {args.out}")
    if args.plot:
        plot(runs, args.plot)
        print(f"wrote {args.plot}")
    return 0
