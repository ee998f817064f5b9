"""``moeflow bench ...``: benchmarks that print a table and write JSON."""

from __future__ import annotations

import argparse
import shlex
import sys

from moeflow.bench.layer import DEFAULT_CASES, bench_worker, format_table, write_json
from moeflow.commands import bench_bigmac, bench_net
from moeflow.commands.common import add_launch_args, run_on_ranks


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (tables + JSON)")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    layer = bsub.add_parser("layer", help="one MoE layer forward+backward, split by phase")
    layer.add_argument("--tokens", type=int, default=2048, help="tokens per rank (2048)")
    layer.add_argument("--d-model", type=int, default=256)
    layer.add_argument("--d-expert", type=int, default=512)
    layer.add_argument("--warmup", type=int, default=2)
    layer.add_argument("--reps", type=int, default=7)
    layer.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun on GPUs)")
    layer.add_argument("--out", default=None, help="write the results as JSON here")
    add_launch_args(layer, default_nproc=1)
    layer.set_defaults(func=run_layer)
    bench_bigmac.register_bench(bsub)
    bench_net.register_bench(bsub)


def run_layer(args: argparse.Namespace) -> int:
    for name in ("tokens", "d_model", "d_expert", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench layer: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    rows = run_on_ranks(bench_worker, args, DEFAULT_CASES, args.tokens, args.d_model,
                        args.d_expert, args.warmup, args.reps, args.device)
    if rows is not None:
        print(format_table(rows))
        if args.out:
            write_json(rows, args.out, "moeflow " + shlex.join(sys.argv[1:]))
            print(f"wrote {args.out}")
    return 0
