"""``moeflow bench curves``: validation loss of ``moeflow train`` runs against steps and wall
clock, side by side (the form of BigMac's Fig. 1), from the runs' ``metrics.jsonl``
(:mod:`moeflow.bench.curves`)."""

from __future__ import annotations

import argparse
import shlex
import sys


def register_bench(bsub) -> None:
    c = bsub.add_parser("curves", help="validation loss of train runs vs steps and wall clock")
    c.add_argument("runs", nargs="+", help="moeflow train run folders (--out of each)")
    c.add_argument("--labels", default=None, help="comma list (default: each run's structure)")
    c.add_argument("--out", default=None,
                   help="write the curves as JSON here (default: print only)")
    c.add_argument("--plot", default=None,
                   help="write a PNG here (needs matplotlib: pip install 'moeflow[plot]'; "
                        "default: no plot)")
    c.set_defaults(func=run_curves)


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
