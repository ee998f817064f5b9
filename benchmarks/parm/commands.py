"""``moeflow bench parm-train`` (:mod:`benchmarks.parm.parm_train`, Table V's analog) and
``moeflow bench parm``: Parm's baseline, S1, S2 (SAA / AAS) and auto side by side (see
:mod:`benchmarks.parm.parm`); run it under ``moeflow cluster run`` for real link differences."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from moeflow.commands.common import add_device_arg, add_launch_args, report, run_on_ranks


def _list(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def register_bench(bsub) -> None:
    p = bsub.add_parser("parm", help="Parm: baseline vs S1 vs S2 (SAA/AAS) vs auto over MP/ESP "
                                     "layouts, with Algorithm 1's predictions")
    p.add_argument("--tokens", type=_list(int), default=[512, 2048],
                   help="tokens per rank B*L, a comma list (default 512,2048)")
    p.add_argument("--d-model", type=int, default=256, help="width M (experts: H = 2M)")
    p.add_argument("--experts-per-ep", type=int, default=2,
                   help="experts per EP rank (num_experts = this x N_EP)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--capacity-factors", type=_list(float), default=[1.2, 2.4],
                   help="f, a comma list (Table III: 1.2,2.4)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps per variant first (>= 1: the auto layer's first "
                        "training step times Algorithm 1's candidates, MoEConfig."
                        "parm_auto_measure)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--collectives", action="store_true",
                   help="also time each collective every schedule runs, alone, at the "
                        "case's sizes, next to its alpha-beta prediction (Eq. 1 / 11 / 14)")
    p.add_argument("--fit-sizes", choices=["grid", "default"], default="grid",
                   help="sizes of the alpha-beta fits the auto layers take: 'grid' spans the "
                        "messages this grid sends (default), 'default' 16Ki-256Ki elements; "
                        "both sets' Algorithm 1 choices are recorded")
    p.add_argument("--layouts", type=_list(str), default=None,
                   help="run these layouts instead of the default grid (N_MP, N_ESP in {1, 2}, "
                        "inside a node): a comma list of MPxEPxESP[:esp-in-node|:ep-in-node], "
                        "e.g. 4x4x1,4x2x2,1x2x4:ep-in-node (N_MP or N_ESP = 4 on 2-rank nodes; "
                        "each row records which groups cross the nodes)")
    add_device_arg(p)
    p.add_argument("--compare", choices=["deepspeed"], default=None,
                   help="time DeepSpeed-MoE's own layer (same weights and gate, N_MP = N_ESP = 2 "
                        "as one group, N_EP = world / 2: 4 or 8 ranks) beside baseline / s1 / s2 / auto and check it "
                        "computes the baseline's outputs; skipped with a message when deepspeed "
                        "is not importable (it is not a moeflow dependency)")
    p.add_argument("--capacity-padding", choices=["pad", "trim", "auto"], default=None,
                   help="MoEConfig.capacity_padding of the moeflow layers (default: the "
                        "config's default, as a user builds it): 'trim' sends only the kept "
                        "rows in the schedules that trim (ted, ted-r4, S1, the baseline with "
                        "whole experts; S2 and the baseline with ESP shards pad), 'pad' all "
                        "E*C rows, 'auto' trims on CPU; recorded in the JSON and printed")
    p.add_argument("--out", default=None,
                   help="write the results as JSON here (default: print only)")
    add_launch_args(p, default_nproc=4)
    p.set_defaults(func=run_parm)

    from benchmarks.parm import parm_train

    p = bsub.add_parser("parm-train", help="Parm's Table V analog: moeflow train step time per "
                                           "MP / ESP layout on an emulated cluster (as root)",
                        description=parm_train.__doc__.split("\n\n")[0])
    parm_train.add_arguments(p)
    p.set_defaults(func=lambda args: parm_train.run(args, "moeflow " + shlex.join(sys.argv[1:])))


def run_parm(args: argparse.Namespace) -> int:
    from benchmarks.parm.parm import bench_worker, format_result

    for name in ("d_model", "experts_per_ep", "top_k", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench parm: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    if args.warmup < 1:
        raise SystemExit(f"moeflow bench parm: --warmup {args.warmup} must be >= 1: the auto "
                         "layer times Algorithm 1's candidates in its first training step "
                         "(MoEConfig.parm_auto_measure), which must not be a timed one")
    opts = {k: getattr(args, k) for k in ("tokens", "d_model", "experts_per_ep", "top_k",
                                          "capacity_factors", "warmup", "reps", "device",
                                          "collectives", "fit_sizes", "capacity_padding")}
    if args.layouts:
        from benchmarks.parm.parm import parse_layout

        if args.compare:
            raise SystemExit("moeflow bench parm: --layouts and --compare deepspeed don't go "
                             "together: the DeepSpeed comparison runs its one layout "
                             "(N_MP = N_ESP = 2 as one group); drop one of them")
        try:
            opts["layouts"] = [parse_layout(t) for t in args.layouts]
        except ValueError as e:
            raise SystemExit(f"moeflow bench parm: --layouts: {e}") from None
    if args.compare == "deepspeed":
        return run_compare_deepspeed(args, opts)
    return report(run_on_ranks(bench_worker, args, opts), args, format_result)


def deepspeed_harness():
    """The DeepSpeed harness, ``benchmarks/deepspeed/parm_deepspeed.py`` of the source checkout
    this moeflow runs from: a peer harness outside the package (the library never imports it),
    loaded here, in the command layer, by its path. The checkout's root goes on ``sys.path`` so
    that the spawned ranks import the same module."""
    import importlib
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "deepspeed" / "parm_deepspeed.py").is_file():
        raise SystemExit("moeflow bench parm --compare deepspeed: the harness "
                         f"benchmarks/deepspeed/parm_deepspeed.py is not under {root}; run it "
                         "from a source checkout of moeflow (it is not part of the package)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks.deepspeed.parm_deepspeed")


def run_compare_deepspeed(args: argparse.Namespace, opts: dict) -> int:
    """``--compare deepspeed``: skip with a message when deepspeed is absent, else run
    ``compare_worker`` of :func:`deepspeed_harness` on the ranks."""
    pd = deepspeed_harness()
    if args.top_k not in (1, 2):
        raise SystemExit(f"moeflow bench parm --compare deepspeed: --top-k {args.top_k} must be "
                         "1 or 2 (DeepSpeed's top-k > 2 gate drops by score, not GShard's order)")
    mp = pd.LAYOUT["mp"]
    ep = pd.ep_for_world(int(os.environ.get("WORLD_SIZE", args.nproc)))    # torchrun sets it
    E = ep * args.experts_per_ep
    for t in args.tokens:
        for f in args.capacity_factors + [E / args.top_k]:
            if not pd.capacity_divides(t, args.top_k, E, f, mp):
                raise SystemExit(f"moeflow bench parm --compare deepspeed: --tokens {t} with "
                                 f"capacity factor {f} gives a capacity ceil(k f T / E) that "
                                 f"N_MP={mp} does not divide (DeepSpeed splits it over the MP "
                                 "group); pick --tokens / --capacity-factors that make it even, "
                                 "e.g. --tokens 512 --capacity-factors 1.25,2.5")
    if not pd.deepspeed_available():
        print(pd.SKIP_MESSAGE)
        return 0
    return report(run_on_ranks(pd.compare_worker, args, opts), args, pd.format_compare)
