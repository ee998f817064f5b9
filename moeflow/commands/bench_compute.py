"""``moeflow bench compute``: fit this device's compute throughput per kernel kind
(:mod:`moeflow.bench.compute`), the compute counterpart of ``moeflow bench links``."""

from __future__ import annotations

import argparse
import json
import os

from moeflow.commands.common import run_meta
from moeflow.registry import did_you_mean


def register_bench(bsub) -> None:
    from moeflow.bench import compute

    p = bsub.add_parser("compute", help="alpha-beta fits of GEMM, expert FFN, attention, "
                                        "elementwise and codec time vs work on this device",
                        description=compute.__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=compute.DEFAULT_ROWS,
                   help="token rows per measured shape, comma-separated (at least 2)")
    p.add_argument("--d-model", type=int, default=1024, help="model width d")
    p.add_argument("--d-expert", type=int, default=4096, help="expert hidden width h")
    p.add_argument("--experts", type=int, default=8, help="local experts of the FFN kernel")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--activation", default="gelu", help="expert activation (gelu, swiglu, ...)")
    p.add_argument("--codecs", default="fp16,int8",
                   help="codecs to time (encode + decode), comma-separated; '' for none")
    p.add_argument("--dtype", default="fp32", choices=sorted(compute.DTYPES),
                   help="tensor dtype")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: one rank's share on a shared machine)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per shape")
    p.add_argument("--reps", type=int, default=5, help="timed calls per shape (median kept)")
    p.add_argument("--out", default=None,
                   help="write the fits as JSON (moeflow.compute/1); a {rank} in the name is "
                        "replaced by the launcher's RANK (0 outside a launcher), so every rank "
                        "of `moeflow cluster run --cpu-per-rank X -- moeflow bench compute` "
                        "writes its own fit, taken under its own CPU quota")
    p.set_defaults(func=run_compute)


def out_path(template: str, env) -> str:
    """`--out` with `{rank}` replaced by the launcher's RANK (torchrun sets it; 0 without one)."""
    if "{rank}" not in template:
        return template
    rank = env.get("RANK", "0")
    if not rank.isdigit():
        raise SystemExit(f"moeflow bench compute: RANK={rank!r} is not a rank number; "
                         "unset it or run under a launcher that sets it")
    return template.replace("{rank}", rank)


def run_compute(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench import compute
    from moeflow.comm.codecs import CODECS
    from moeflow.devices import check_device

    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise SystemExit(f"moeflow bench compute: --rows {args.rows!r} is invalid; give "
                         "comma-separated integers, e.g. 64,256,1024,4096")
    codecs = [c for c in args.codecs.split(",") if c]
    for c in codecs:
        if c not in CODECS:
            raise SystemExit(f"moeflow bench compute: unknown codec {c!r}; registered: "
                             f"{', '.join(sorted(CODECS))}{did_you_mean(c, CODECS)}")
    for name in ("d_model", "d_expert", "experts", "heads", "threads", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench compute: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} is invalid; it must be >= 1")
    device = check_device(args.device)
    torch.set_num_threads(args.threads)
    try:
        res = compute.measure(rows, args.d_model, args.d_expert, args.experts, args.heads,
                              compute.DTYPES[args.dtype], device, args.activation, codecs,
                              args.warmup, args.reps, progress=print)
    except ValueError as err:
        raise SystemExit(f"moeflow bench compute: {err}")
    print(compute.format_table(res))
    if args.out:
        out = out_path(args.out, os.environ)
        res["run_meta"] = run_meta()
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {out}")
    return 0
