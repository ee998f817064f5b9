"""``moeflow bench ...``: benchmarks that print a table and write JSON."""

from __future__ import annotations

import argparse
import shlex
import sys

from moeflow.bench.layer_bench import bench_worker, format_table, write_json
from moeflow.cases.layer_grid import cases_for
from moeflow.commands import bench_compute, bench_curves, bench_net, bench_pipeline
from moeflow.commands.bench_papers import BenchChoices, register_paper_benchmarks
from moeflow.commands.layer_args import add_layer_args
from moeflow.commands.common import (add_device_arg, add_launch_args, cpu_per_rank_record,
                                     report, run_on_ranks)
from moeflow.registry import did_you_mean


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (tables + JSON)")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH", action=BenchChoices)
    layer = bsub.add_parser("layer", help="one MoE layer forward+backward, split by phase")
    add_layer_args(layer)
    layer.set_defaults(func=run_layer)
    bench_compute.register_bench(bsub)
    bench_curves.register_bench(bsub)
    bench_net.register_bench(bsub)
    bench_pipeline.register_bench(bsub)
    register_paper_benchmarks(bsub)

    sched = bsub.add_parser("schedule", help="ScheMoE ablation (codec, Pipe-A2A, OptSche) and "
                                             "the profiler-driven chooser on one MoE layer")
    sched.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    sched.add_argument("--d-model", type=int, default=512, help="model width (d_model)")
    sched.add_argument("--d-expert", type=int, default=1024, help="hidden width of each expert")
    sched.add_argument("--experts-per-rank", type=int, default=1,
                       help="experts held by each rank (num_experts = this x ranks)")
    sched.add_argument("--top-k", type=int, default=1, help="experts per token")
    sched.add_argument("--capacity-factor", type=float, default=1.2,
                       help="expert capacity as a multiple of the even share of tokens")
    sched.add_argument("--codec", default="fp16", help="the codec of the +codec variants")
    sched.add_argument("--r", type=int, default=2, help="pipelining degree of the last rows")
    sched.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    sched.add_argument("--reps", type=int, default=5, help="timed steps per variant")
    sched.add_argument("--choose", action="store_true",
                       help="also profile, choose codec/a2a/r/schedule, and measure the choice")
    sched.add_argument("--trace", default=None,
                       help="write a Chrome trace JSON of the last variant here (default: none)")
    sched.add_argument("--gantt", default=None,
                       help="write a PNG timeline of the last variant here (default: none)")
    add_device_arg(sched)
    sched.add_argument("--out", default=None,
                       help="write the results as JSON here (default: print only)")
    add_launch_args(sched, default_nproc=1)
    sched.set_defaults(func=run_schedule)

    register_codecs_bench(bsub)
    register_zfp_arrays_bench(bsub)


def run_layer(args: argparse.Namespace) -> int:
    for name in ("tokens", "d_model", "d_expert", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench layer: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    from moeflow.schedule import SCHEDULERS
    from moeflow.registry import did_you_mean

    if args.compare is not None:
        return run_compare(args)
    schedules = args.schedules.split(",")
    for s in schedules:
        if s not in SCHEDULERS:
            raise SystemExit(f"moeflow bench layer: --schedules has {s!r}; choose from "
                             f"{', '.join(sorted(SCHEDULERS))}{did_you_mean(s, SCHEDULERS)}")
    from moeflow.cases.layer_grid import EXCHANGE_STRATEGIES
    from moeflow.comm.alltoall import ALLTOALLS
    algorithms = tuple(args.algorithms.split(","))
    known = sorted([*ALLTOALLS, *EXCHANGE_STRATEGIES])
    for a in algorithms:
        if a not in known:
            raise SystemExit(f"moeflow bench layer: --algorithms has {a!r}; choose from "
                             f"{', '.join(known)}{did_you_mean(a, known)}")
    cases = cases_for(schedules, args.pipeline_degree, algorithms, args.num_experts)
    if args.codec != "none" or args.codec_backward:
        cases = _codec_cases(args, cases)
    rows = run_on_ranks(bench_worker, args, cases, args.tokens, args.d_model,
                        args.d_expert, args.warmup, args.reps, args.device, args.local_size)
    if rows is not None:
        print(format_table(rows))
        if args.out:
            write_json(rows, args.out, "moeflow " + shlex.join(sys.argv[1:]),
                       cpu_per_rank_record(args))
            print(f"wrote {args.out}")
    return 0


def _codec_cases(args: argparse.Namespace, cases: list) -> list:
    """bench layer's rows under ``--codec`` / ``--codec-backward``, every config checked before
    any rank starts (a codec the layer refuses, e.g. with ``node_dedup``, names the row)."""
    from moeflow.cases.layer_grid import case_config, with_codec
    from moeflow.comm.codecs import CODECS
    from moeflow.config import ConfigError

    if args.codec not in CODECS:
        raise SystemExit(f"moeflow bench layer: --codec {args.codec!r} is not a registered "
                         f"codec; choose from {', '.join(sorted(CODECS))}"
                         f"{did_you_mean(args.codec, CODECS)} ('auto:lossy' is tuned at run "
                         "time: --compare only)")
    if args.codec_backward and args.codec == "none":
        raise SystemExit("moeflow bench layer: --codec-backward compresses the backward's "
                         "payloads with --codec NAME; give a codec (e.g. --codec int8)")
    cases = with_codec(cases, args.codec, args.codec_backward)
    for c in cases:
        try:
            case_config(c, args.d_model, args.d_expert)
        except ConfigError as e:
            raise SystemExit(f"moeflow bench layer: config {c.name} with --codec "
                             f"{args.codec}: {e}") from None
    return cases


def run_compare(args: argparse.Namespace) -> int:
    from moeflow.bench.compare import all_peers, compare_worker, format_compare
    from moeflow.config import ConfigError

    PEERS = all_peers()
    if args.compare not in PEERS:
        raise ConfigError(f"--compare {args.compare!r} is not a known peer; choose from "
                          f"{', '.join(PEERS)}{did_you_mean(args.compare, PEERS)}")
    peer = PEERS[args.compare]
    why = peer.missing()
    if why:
        print(f"moeflow bench layer --compare {args.compare}: skipped: {why}")
        return 0
    in_process = getattr(peer, "in_process", True)
    python = None if in_process else peer.check_python(args.peer_python)
    if in_process and args.peer_python:
        raise ConfigError(f"--peer-python {args.peer_python!r}: --compare {args.compare} runs "
                          "in this process; drop it (torchtitan and megatron take it)")
    if args.dtype not in ("fp32", "bf16"):
        raise ConfigError(f"--dtype {args.dtype!r}: fp32 or bf16")
    if args.dtype == "bf16" and in_process:
        raise ConfigError(f"--dtype bf16 is for the peers with an interpreter of their own "
                          f"(torchtitan, megatron), not --compare {args.compare}; drop --dtype")
    if args.codec_backward:
        raise SystemExit("moeflow bench layer --compare: --codec-backward applies to bench "
                         "layer's own rows; drop it (the peer comparison compresses the "
                         "forward only)")
    if args.warmup < 1:
        raise SystemExit("moeflow bench layer --compare: --warmup must be >= 1 (moeflow's auto "
                         "settings are tuned in the first warm-up step)")
    degree = args.degree if args.degree == "auto" else int(args.degree)
    opts = {"tokens": args.tokens, "d_model": args.d_model, "d_expert": args.d_expert,
            "num_experts": args.num_experts, "top_k": args.top_k,
            "capacity_factor": args.capacity_factor or None, "activation": args.activation,
            "peer_python": python, "dtype": args.dtype, "a2a": args.a2a, "schedule": args.schedule, "pipeline_degree": degree,
            "warmup": args.warmup, "reps": args.reps, "device": args.device,
            "input_grad": args.input_grad, "codec": args.codec,
            "lossy_error_budget": args.lossy_error_budget, "placement": args.placement,
            "autotune_budget_s": (None if args.autotune_budget.lower() == "none"
                                  else float(args.autotune_budget))}
    return report(run_on_ranks(compare_worker, args, args.compare, opts), args,
                   format_compare)


def run_schedule(args: argparse.Namespace) -> int:
    from moeflow.bench.schedule_bench import bench_worker, format_result
    from moeflow.comm.codecs import CODECS
    from moeflow.config import ConfigError

    if args.codec not in CODECS:
        raise ConfigError(f"--codec {args.codec!r} is not registered; registered: "
                          f"{', '.join(sorted(CODECS))}{did_you_mean(args.codec, CODECS)}")
    opts = {k: getattr(args, k) for k in ("tokens", "d_model", "d_expert", "experts_per_rank",
                                          "top_k", "capacity_factor", "codec", "r", "warmup",
                                          "reps", "choose", "trace", "gantt", "device")}
    return report(run_on_ranks(bench_worker, args, opts), args, format_result)


def register_codecs_bench(bsub) -> None:
    p = bsub.add_parser("codecs", help="codec throughput vs copy bandwidth, bits/value, error")
    p.add_argument("--codecs", default=None,
                   help="comma-separated codec names (default: fp16,bf16,int8,fp8,fp8-row,zfp,"
                        "zfpy)")
    p.add_argument("--sizes", default=None,
                   help="ROWSxCOLS,... (default: 2048x128,8192x512 on CPU; "
                        "8192x1024,65536x1024,65536x4096 on CUDA)")
    add_device_arg(p)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: zfpy is single-threaded, and on a shared "
                        "machine more threads contend)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    p.add_argument("--reps", type=int, default=5, help="timed calls")
    p.add_argument("--train-steps", type=int, default=0,
                   help="train the tiny GPT this many steps before taking its activations")
    p.add_argument("--error-rows", type=int, default=2048,
                   help="rows (of 512 values) of the Gaussian and smooth error data")
    p.add_argument("--zfp-rate", type=float, default=8.0,
                   help="bits per value of the zfp and zfpy codecs")
    p.add_argument("--out", default=None,
                   help="write the results as JSON here (default: print only)")
    p.set_defaults(func=run_codecs)


def run_codecs(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench import codecs_bench as bc
    from moeflow.comm.codecs import CODECS
    from moeflow.devices import check_device

    names = bc.DEFAULT_CODECS if args.codecs is None else args.codecs.split(",")
    for n in names:
        if n not in CODECS:
            raise SystemExit(f"moeflow bench codecs: unknown codec {n!r}; registered: "
                             f"{', '.join(sorted(CODECS))}{did_you_mean(n, CODECS)}")
    device = check_device(args.device)
    if args.reps < 1 or args.threads < 1 or args.error_rows < 1:
        raise SystemExit("moeflow bench codecs: --reps, --threads and --error-rows must be >= 1")
    if not args.zfp_rate >= 2.25:
        raise SystemExit(f"moeflow bench codecs: --zfp-rate {args.zfp_rate} is invalid; use a "
                         "rate of at least 2.25 bits per value (9 bits per block of 4)")
    try:
        sizes = (bc.parse_sizes(args.sizes) if args.sizes else
                 bc.DEFAULT_SIZES_CUDA if device == "cuda" else
                 bc.DEFAULT_SIZES_CPU)
    except ValueError as err:
        raise SystemExit(f"moeflow bench codecs: {err}")
    torch.set_num_threads(args.threads)
    res = bc.run(names, sizes, device, args.warmup, args.reps, args.train_steps,
                 args.error_rows, args.zfp_rate)
    print(bc.format_table(res))
    if args.out:
        bc.write_json(res, args.out, "moeflow " + shlex.join(sys.argv[1:]))
        print(f"wrote {args.out}")
    return 0


def register_zfp_arrays_bench(bsub) -> None:
    p = bsub.add_parser("zfp-arrays", help="our ZFP vs zfpy on 1-, 2- and 3-D arrays: speed, "
                                           "same bytes")
    p.add_argument("--shapes", default="1048576,1024x1024,64x128x128",
                   help="array shapes, 1 to 3 axes each (dims = axes), comma-separated")
    p.add_argument("--rate", type=float, default=8.0, help="bits per value")
    add_device_arg(p)                                   # ours; zfpy runs on CPU
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1, as zfpy)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    p.add_argument("--reps", type=int, default=5, help="timed calls")
    p.add_argument("--out", default=None,
                   help="write the results as JSON here (default: print only)")
    p.set_defaults(func=run_zfp_arrays)


def run_zfp_arrays(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench import zfp_arrays as za
    from moeflow.bench.codecs_bench import write_json as write_json_codecs
    from moeflow.comm.codecs.zfp import maxbits_for
    from moeflow.devices import check_device

    device = check_device(args.device)
    if args.reps < 1 or args.threads < 1 or args.warmup < 0:
        raise SystemExit("moeflow bench zfp-arrays: --reps and --threads must be >= 1, "
                         "--warmup >= 0")
    try:
        shapes = za.parse_shapes(args.shapes)
        for s in shapes:
            maxbits_for(args.rate, len(s))
    except ValueError as err:
        raise SystemExit(f"moeflow bench zfp-arrays: {err}")
    if args.rate * 4 < 9:
        raise SystemExit(f"moeflow bench zfp-arrays: --rate {args.rate} is invalid: zfpy needs "
                         "at least 9 bits per block of 4 values in 1-D (rate >= 2.25)")
    torch.set_num_threads(args.threads)
    try:
        res = za.run(shapes, args.rate, device, args.warmup, args.reps)
    except RuntimeError as err:
        raise SystemExit(f"moeflow bench zfp-arrays: {err}")
    print(za.format_table(res))
    if args.out:
        write_json_codecs(res, args.out, "moeflow " + shlex.join(sys.argv[1:]))
        print(f"wrote {args.out}")
    return 0
