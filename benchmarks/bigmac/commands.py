"""``moeflow bench bigmac``: BigMac's expert structures side by side on one MoE layer (BigMac
Section 5's layer comparison; see :mod:`benchmarks.bigmac.bigmac`)."""

from __future__ import annotations

import argparse
import shlex
import sys

from moeflow.commands.bigmac_args import add_bigmac_args, bigmac_cases
from moeflow.commands.common import cpu_per_rank_record, run_on_ranks


def register_bench(bsub) -> None:
    p = bsub.add_parser("bigmac", help="fine-grained vs BigMac MoE layer: step time, phases, "
                                       "all-to-all bytes counted vs computed")
    add_bigmac_args(p)
    p.set_defaults(func=run_bigmac)


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
