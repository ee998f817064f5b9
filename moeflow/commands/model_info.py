"""``moeflow model-info``: parameters, FLOPs and all-to-all bytes per token of a model config
as vanilla, fine-grained and BigMac (BigMac Tables 3-4), before training anything.

The config is ``--preset`` plus ``--set`` overrides (as in ``moeflow train``). A vanilla config
is split into ``--granularity`` finer experts for the other two rows; any other config is the
fine-grained shape, merged for the vanilla row. Formulas: ``moeflow/models/cost.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from moeflow.commands.common import parse_overrides
from moeflow.config import ModelConfig, PRESETS, model_preset
from moeflow.models.cost import format_costs, model_cost, structure_variants


def register(sub) -> None:
    p = sub.add_parser("model-info", help="params / FLOPs / all-to-all bytes per structure",
                       description=__doc__)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=V",
                   help="override a ModelConfig field, e.g. --set moe.structure=fine_grained "
                        "--set moe.num_experts=32 --set moe.d_expert=64 --set moe.top_k=8 "
                        "(default: none)")
    p.add_argument("--granularity", type=int, default=4,
                   help="fine-grained experts per vanilla expert")
    p.add_argument("--downscale-factor", type=float, default=None,
                   help="BigMac's r for the bigmac row (default: the config's, else 0.25)")
    p.add_argument("--bytes-per-element", type=int, default=4,
                   help="bytes of one communicated element (4 float32, 2 fp16/bf16)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size for the off-rank column")
    p.add_argument("--tokens", type=int, default=None,
                   help="also print totals for a batch of this many tokens (default: per "
                        "token only)")
    p.add_argument("--out", default=None,
                   help="write the rows as JSON here (default: print only)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in ("bytes_per_element", "ep"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow model-info: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    cfg = model_preset(args.preset, **parse_overrides(args.overrides, ModelConfig))
    variants = structure_variants(cfg, args.granularity, args.downscale_factor)
    costs = [model_cost(v, args.bytes_per_element, args.ep) for v in variants]
    print(format_costs(costs, args.tokens))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "moeflow " + shlex.join(sys.argv[1:]),
                       "configs": [dataclasses.asdict(v) for v in variants],
                       "tokens": args.tokens,
                       "rows": [dataclasses.asdict(c) for c in costs]}, f, indent=2)
        print(f"wrote {args.out}")
    return 0
