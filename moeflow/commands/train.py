"""``moeflow train``: train the MoE GPT (default: the tiny preset on the embedded corpus, on
2 CPU ranks spawned here; under torchrun, the ranks torchrun started).

On GPUs, one rank per GPU, each on cuda:LOCAL_RANK, in bf16 autocast by default:
  torchrun --nproc-per-node 8 -m moeflow.cli train --preset small --dtype bf16
  moeflow train --device cuda --nproc 2 --preset small      (2 local ranks, 2 GPUs)"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from moeflow.commands.common import (add_device_arg, add_launch_args, parse_overrides,
                                     run_on_ranks)
from moeflow.config import DTYPES, ModelConfig, PRESETS, TrainConfig, model_preset
from moeflow.train import train_worker


def register(sub) -> None:
    p = sub.add_parser("train", help="train the MoE GPT",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="model size (default tiny: trains on 2 CPU cores in minutes)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=V",
                   help="override a ModelConfig field, e.g. --set top_k=1 --set "
                        "capacity_factor=none (dropless); repeatable")
    p.add_argument("--data", default=None,
                   help="a text file or folder (default: CPython's embedded documentation)")
    p.add_argument("--out", default=None, help="run folder (default runs/<preset>-<time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("collective_timeout_s", "device", "dtype"):
            continue
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=getattr(
            defaults, f.name), type=type(getattr(defaults, f.name)) if getattr(
            defaults, f.name) is not None else int, help=f"(default {getattr(defaults, f.name)})")
    add_device_arg(p, default=defaults.device)
    p.add_argument("--dtype", default=defaults.dtype, choices=DTYPES,
                   help=f"forward precision (default {defaults.dtype}): bf16 runs forward passes "
                        "under bf16 autocast (weights, gradients and optimizer state stay fp32); "
                        "auto is bf16 on cuda and fp32 on cpu")
    add_launch_args(p, default_nproc=2)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    mcfg = model_preset(args.preset, **parse_overrides(args.overrides, ModelConfig))
    tcfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                          if f.name != "collective_timeout_s"},
                       collective_timeout_s=args.timeout)
    if args.data is not None and not Path(args.data).exists():
        raise FileNotFoundError(f"--data {args.data}: no such file or folder")
    if args.resume and args.out is None:
        raise SystemExit("moeflow train: --resume needs --out (the run folder to continue)")
    out = args.out or str(Path("runs") / f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    start = time.perf_counter()
    result = run_on_ranks(train_worker, args, mcfg, tcfg, out, args.data, args.resume,
                          not args.no_progress)
    if result is not None:
        vals = [(r["step"], r["val_loss"]) for r in result["history"] if "val_loss" in r]
        print(f"done: {result['step']} steps in {time.perf_counter() - start:.0f}s, "
              f"validation loss {result['final_val_loss']:.3f} nats/byte")
        print("validation curve (step: nats/byte): "
              + ", ".join(f"{s}: {v:.3f}" for s, v in vals))
        print(f"metrics: {Path(out) / 'metrics.jsonl'}  checkpoint: "
              f"{Path(out) / 'checkpoint'}")
        print(json.dumps({"final_val_loss": result["final_val_loss"], "steps": result["step"]}))
    return 0
