"""What every ``moeflow simulate`` command shares: the model arguments (``--links`` read as
``--link-model``, ``--compute``, ``--profile``), ``--out-summary``, and the JSON its
predictions are written as."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from moeflow.commands.common import run_meta


def add_model_args(g, profile_example: str = "schemoe-32gpu") -> None:
    """The models every ``simulate`` command reads: ``--links`` (read as ``--link-model``),
    ``--compute``, ``--profile``."""
    g.add_argument("--links", default=None, metavar="JSON",
                   help="link fits from `moeflow bench links --out` (default: the profile's)")
    g.add_argument("--link-model", default="curve", choices=("curve", "fit"),
                   help="how --links is read: curve (default) interpolates each collective's "
                        "measured sizes, fit uses its alpha-beta line over all sizes")
    g.add_argument("--compute", default=None, metavar="JSON",
                   help="compute fits from `moeflow bench compute --out` (default: the "
                        "profile's)")
    g.add_argument("--profile", default=None, metavar="NAME",
                   help="a hardware profile (file or built-in name, e.g. "
                        f"{profile_example}) for what --links / --compute do not give")


def add_out_summary(group) -> None:
    group.add_argument("--out-summary", action="store_true",
                       help="with --out: leave out each row's per-task and per-collective "
                            "lists (thousands of entries at tens of ranks), keep the step "
                            "times and their breakdown")


def zipf_routing(args: argparse.Namespace, spec, world: int, tokens: int):
    """``simulate train``'s routing of every MoE layer: ``(None, "uniform")``, or with
    ``--zipf`` a sampled routing of ``tokens`` per rank over ``world`` ranks and its label."""
    if args.zipf is None:
        return None, "uniform"
    from moeflow.simulate.loads import sample_routing, zipf_popularity
    routing = sample_routing(zipf_popularity(spec.num_experts, args.zipf), world, tokens,
                             spec.top_k, args.routing_seed)
    return routing, f"zipf {args.zipf}, seed {args.routing_seed}"


def write_rows(args: argparse.Namespace, costs, rows: list, **extra) -> int:
    """With --out, the predicted rows as JSON with the command, the fits' source, the
    provenance (:func:`run_meta`) and ``extra``."""
    if args.out:
        if args.out_summary:
            rows = [{k: v for k, v in r.items() if k not in ("tasks", "collectives")}
                    for r in rows]
        with open(args.out, "w") as f:
            json.dump({"command": "moeflow " + shlex.join(sys.argv[1:]),
                       "models": costs.source, **run_meta(), "results": rows, **extra}, f,
                      indent=1)
        print(f"wrote {args.out}")
    return 0
