"""``moeflow bench smile``: SMILE's bi-level routing against flat top-1 routing on one MoE layer,
layer and all-to-all time (SMILE Section 4's comparison; needs several nodes), see
:mod:`benchmarks.smile.smile`."""

from __future__ import annotations

import argparse

from moeflow.commands.common import add_device_arg, add_launch_args, report, run_on_ranks


def register_bench(bsub) -> None:
    smile = bsub.add_parser("smile", help="SMILE: bi-level vs flat top-1 routing, layer and "
                                          "all-to-all time (needs several nodes)")
    smile.add_argument("--tokens", type=int, nargs="+", default=[256, 4096],
                       help="tokens per rank; several values = small and large messages")
    smile.add_argument("--d-model", type=int, default=256, help="model width (d_model)")
    smile.add_argument("--d-expert", type=int, default=512, help="hidden width of each expert")
    smile.add_argument("--experts-per-rank", type=int, default=1,
                       help="experts held by each rank (num_experts = this x ranks)")
    smile.add_argument("--capacity-factor", type=float, default=2.0,
                       help="expert capacity as a multiple of the even share of tokens")
    smile.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    smile.add_argument("--reps", type=int, default=5, help="timed steps")
    add_device_arg(smile)
    smile.add_argument("--out", default=None,
                       help="write the results as JSON here (default: print only)")
    add_launch_args(smile, default_nproc=1)
    smile.set_defaults(func=run_smile)


def run_smile(args: argparse.Namespace) -> int:
    from benchmarks.smile.smile import bench_worker, format_result
    from moeflow.config import ConfigError
    from moeflow.launch import under_torchrun

    if not under_torchrun():
        raise ConfigError("moeflow bench smile needs several nodes: run it under "
                          "`moeflow cluster run --nodes N --ranks-per-node M -- python -m "
                          "moeflow.cli bench smile`, or torchrun on several nodes")
    opts = {k: getattr(args, k) for k in ("tokens", "d_model", "d_expert", "experts_per_rank",
                                          "capacity_factor", "warmup", "reps", "device")}
    return report(run_on_ranks(bench_worker, args, opts), args, format_result)
