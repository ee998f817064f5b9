"""The arguments and cases of ``moeflow bench bigmac`` (BigMac Section 5's layer comparison), which
``moeflow simulate bigmac`` takes too, so that every predicted row has a measured twin."""

from __future__ import annotations

import argparse

from moeflow.commands.common import add_device_arg, add_launch_args
from moeflow.config import STRUCTURES
from moeflow.registry import did_you_mean


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def add_bigmac_args(p: argparse.ArgumentParser) -> None:
    """``bench bigmac``'s arguments (``moeflow simulate bigmac`` takes the same ones, so every
    predicted row has a measured twin)."""
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=512, help="model width (d_model)")
    p.add_argument("--d-expert", type=int, default=128,
                   help="fine-grained expert width F (BigMac experts: F/r)")
    p.add_argument("--num-experts", type=int, default=16, help="fine-grained experts E")
    p.add_argument("--top-k", type=_int_list, default=[4, 8],
                   help="experts per token, a comma list: one row per value (default 4,8)")
    p.add_argument("--downscale-factor", type=float, default=0.25, help="BigMac's r")
    p.add_argument("--structures", default="fine_grained,bigmac",
                   help=f"comma list from {','.join(STRUCTURES)}")
    p.add_argument("--granularity", type=int, default=4,
                   help="vanilla row: E/g experts of width F*g, top k/g")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--reps", type=int, default=5, help="timed steps")
    add_device_arg(p)
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op CPU threads per rank (default: cores / ranks); 1 makes the "
                        "CPU-time column robust on a shared machine")
    p.add_argument("--out", default=None,
                   help="write the results as JSON here (default: print only)")
    add_launch_args(p, default_nproc=1)


def bigmac_cases(args: argparse.Namespace, command: str) -> list:
    """The checked arguments' cases (:func:`moeflow.cases.structures.default_cases`)."""
    from moeflow.cases.structures import default_cases

    for name in ("tokens", "d_model", "d_expert", "num_experts", "reps", "granularity"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow {command}: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    structures = [s for s in args.structures.split(",") if s]
    bad = [s for s in structures if s not in STRUCTURES]
    if bad or not structures:
        raise SystemExit(f"moeflow {command}: --structures {args.structures!r}: choose from "
                         f"{', '.join(STRUCTURES)}"
                         f"{did_you_mean(bad[0], STRUCTURES) if bad else ''}")
    return default_cases(args.num_experts, args.d_expert, args.top_k, args.downscale_factor,
                         structures, args.granularity)
