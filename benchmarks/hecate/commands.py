"""HECATE's ``moeflow bench`` subcommands. ``hecate``: EP vs FSSDP on one MoE layer under
Zipf-like skewed loads (Sections 3-4, :mod:`benchmarks.hecate.hecate`); ``spag`` and
``spag-overlap``: the sparse all-gather's transports and how much of it the attention hides
(Section 4.1, :mod:`benchmarks.hecate.spag`, :mod:`benchmarks.hecate.spag_overlap`);
``hecate-train``: ``moeflow train`` end to end (Section 5, :mod:`benchmarks.hecate.hecate_train`);
``hecate-fit`` and ``hecate-model``: HECATE on a whole GPT of several MoE layers under skewed
loads -- peak memory per rank and the largest batch under a budget
(:mod:`benchmarks.hecate.hecate_fit`), and interleaved step times with the chosen ``P'``
(:mod:`benchmarks.hecate.hecate_model`)."""

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
    from benchmarks.hecate import hecate_fit

    _register_layer_benches(bsub)
    _register_train_bench(bsub)

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
    from benchmarks.hecate.hecate_model import parse_mode
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
    from benchmarks.hecate import hecate_fit

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
    from benchmarks.hecate.hecate_model import format_time, time_worker

    for name in ("batch", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench hecate-model: --{name} {getattr(args, name)} "
                             "must be >= 1")
    opts = {**_opts(args, "hecate-model"), "batch": args.batch, "reps": args.reps}
    return report(run_on_ranks(time_worker, args, opts), args, format_time)


def _register_train_bench(bsub) -> None:
    from benchmarks.hecate import hecate_train

    p = bsub.add_parser("hecate-train", help="HECATE end to end: moeflow train's step under EP, "
                                             "shadowing, re-placement, HECATE and HECATE-RM "
                                             "(interleaved, paired ratios over EP, losses, loads)",
                        description=hecate_train.__doc__.splitlines()[0])
    hecate_train.add_arguments(p)
    p.set_defaults(func=hecate_train.run)


def _register_layer_benches(bsub) -> None:
    """HECATE (Sections 3-4): EP vs FSSDP on one MoE layer under Zipf-like skewed loads."""
    p = bsub.add_parser("hecate", help="HECATE: EP, shadowing, FSSDP (Algorithms 1, 2, RM) "
                                       "under skewed loads: step/a2a time, loads, bytes, memory")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=256, help="model width (d_model)")
    p.add_argument("--d-expert", type=int, default=512, help="hidden width of each expert")
    p.add_argument("--experts-per-rank", type=int, default=2,
                   help="experts owned by each rank at the start (num_experts = this x ranks)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--zipf", type=float, nargs="+", default=[0.0, 1.0, 1.5],
                   help="skew exponents s (0 = no skew)")
    p.add_argument("--t", type=int, default=2, help="Algorithm 1's overlap degree t")
    p.add_argument("--m", type=int, default=2, help="Algorithm 1's memory capacity m")
    p.add_argument("--shadow", type=int, default=None,
                   help="experts FasterMoE-style shadowing replicates everywhere (default: t)")
    p.add_argument("--reshard-every", type=int, nargs="*", default=[],
                   help="extra 'hecate reshard/K' variants re-sharding every K timed steps")
    p.add_argument("--replace-every", type=int, default=5,
                   help="the 'replace' variant (SmartMoE-style) re-places experts every K "
                        "timed steps (and once after the warm-up)")
    p.add_argument("--variants", default=None,
                   help="comma-separated variant labels to run (default: all), e.g. "
                        "'ep,shadow,replace,hecate'")
    p.add_argument("--router-loads", default=None, metavar="PATH:RUN:LAYER",
                   help="also run with a real router's per-expert loads: entry RUN, MoE layer "
                        "LAYER of a `moeflow bench router-load` JSON")
    p.add_argument("--drift", type=int, default=0,
                   help="rotate the experts' popularity every N steps (0: fixed loads)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--reps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_launch_args(p, default_nproc=1)
    p.set_defaults(func=run_hecate)
    q = bsub.add_parser("spag", help="HECATE spAG / spRS: the point-to-point and the "
                                     "grouped-broadcast transports, interleaved")
    q.add_argument("--chunk-bytes", type=int, default=1 << 20, help="bytes of one expert")
    q.add_argument("--experts-per-rank", type=int, default=2, help="experts owned per rank")
    q.add_argument("--replicas", type=int, nargs="+", default=[1, 3],
                   help="each expert gets 0..N extra holders (random, seeded)")
    q.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    q.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    q.add_argument("--out", default=None, help="write the results as JSON here")
    add_launch_args(q, default_nproc=1)
    q.set_defaults(func=run_spag)
    o = bsub.add_parser("spag-overlap", help="HECATE's early spAG: how much of it the GPT "
                                             "block's attention forward hides, per transport")
    o.add_argument("--d-model", type=int, default=256, help="model width")
    o.add_argument("--n-heads", type=int, default=4, help="attention heads")
    o.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    o.add_argument("--batch", type=int, default=4, help="sequences per rank")
    o.add_argument("--d-expert", type=int, default=512, help="hidden width of each expert")
    o.add_argument("--experts-per-rank", type=int, default=2, help="experts owned per rank")
    o.add_argument("--replicas", type=int, default=3,
                   help="each expert gets 0..N extra holders (random, seeded)")
    o.add_argument("--transports", nargs="+", default=["p2p", "broadcast"],
                   choices=["p2p", "broadcast"], help="spAG transports to time")
    o.add_argument("--backward", action="store_true",
                   help="instead: forward + backward with the spRS on the critical path vs on "
                        "the lane under the attention backward (fssdp.overlap_backward); the "
                        "first --transports entry")
    o.add_argument("--regather", action="store_true",
                   help="instead: forward + backward of an FSSDP block (HECATE-RM) and the "
                        "dense block after it, with the re-gathering spAG on the critical path "
                        "vs on the lane under the next attention backward "
                        "(fssdp.overlap_regather); the first --transports entry")
    o.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    o.add_argument("--reps", type=int, default=7, help="timed repetitions per variant")
    o.add_argument("--out", default=None, help="write the results as JSON here")
    add_launch_args(o, default_nproc=1)
    o.set_defaults(func=run_spag_overlap)


def run_spag(args: argparse.Namespace) -> int:
    from benchmarks.hecate.spag import bench_worker, format_result

    opts = {k: getattr(args, k) for k in ("chunk_bytes", "experts_per_rank", "replicas",
                                          "warmup", "reps")}
    return report(run_on_ranks(bench_worker, args, opts), args, format_result)


def run_spag_overlap(args: argparse.Namespace) -> int:
    from benchmarks.hecate.spag_overlap import (backward_worker, bench_worker, format_result,
                                            regather_worker)

    for name in ("d_model", "n_heads", "seq_len", "batch", "d_expert", "experts_per_rank",
                 "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench spag-overlap: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    if args.d_model % args.n_heads:
        raise SystemExit(f"moeflow bench spag-overlap: --d-model {args.d_model} must be a "
                         f"multiple of --n-heads {args.n_heads}")
    opts = {k: getattr(args, k) for k in ("d_model", "n_heads", "seq_len", "batch", "d_expert",
                                          "experts_per_rank", "replicas", "transports",
                                          "warmup", "reps")}
    if args.backward and args.regather:
        raise SystemExit("moeflow bench spag-overlap: --backward and --regather are two "
                         "different measurements; give one")
    worker = (backward_worker if args.backward else regather_worker if args.regather
              else bench_worker)
    return report(run_on_ranks(worker, args, opts), args, format_result)


def run_hecate(args: argparse.Namespace) -> int:
    from benchmarks.hecate.hecate import bench_worker, format_result

    for name in ("tokens", "d_model", "d_expert", "experts_per_rank", "top_k", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench hecate: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    for name in ("drift", "t", "m"):
        if getattr(args, name) < 0:
            raise SystemExit(f"moeflow bench hecate: --{name} {getattr(args, name)} must be "
                             ">= 0")
    if any(k < 1 for k in args.reshard_every):
        raise SystemExit(f"moeflow bench hecate: --reshard-every {args.reshard_every}: every "
                         "interval must be >= 1 timed steps")
    if args.replace_every < 1:
        raise SystemExit(f"moeflow bench hecate: --replace-every {args.replace_every} must be "
                         ">= 1 timed steps")
    opts = {k: getattr(args, k) for k in ("tokens", "d_model", "d_expert", "experts_per_rank",
                                          "top_k", "zipf", "t", "m", "warmup", "reps",
                                          "reshard_every", "drift", "replace_every")}
    if args.variants:
        from benchmarks.hecate.hecate import variants

        known = [label for label, _ in variants(args.t, args.m, args.reshard_every)]
        chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in chosen if v not in known]
        if bad or not chosen:
            raise SystemExit(f"moeflow bench hecate: --variants {args.variants!r} has unknown "
                             f"labels {bad}; choose from {', '.join(known)}")
        opts["variants"] = chosen
    opts["shadow"] = args.t if args.shadow is None else args.shadow
    if args.router_loads:
        from benchmarks.hecate.hecate import read_router_loads

        try:
            opts["router_loads"], opts["router_loads_source"] = read_router_loads(
                args.router_loads)
        except (OSError, ValueError, KeyError, IndexError) as err:
            raise SystemExit(f"moeflow bench hecate: --router-loads {args.router_loads!r}: "
                             f"{err} (give PATH:RUN:LAYER of a `moeflow bench router-load --out` JSON)")
    return report(run_on_ranks(bench_worker, args, opts), args, format_result)
