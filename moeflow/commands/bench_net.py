"""``moeflow bench links`` and ``moeflow bench a2a``: link alpha-beta fits and all-to-all times.

Both run on the ranks of the job they are started in (torchrun, ``moeflow cluster run``), or on
``--nproc`` local ranks (one node).
"""

from __future__ import annotations

import argparse

from moeflow.bench import a2a, links
from moeflow.measure.linkmodel import save_fits
from moeflow.cluster.shaping import parse_rate
from moeflow.commands.common import add_device_arg, add_launch_args, run_meta, run_on_ranks
from moeflow.config import ConfigError
from moeflow.registry import did_you_mean


def register_bench(bsub) -> None:
    p = bsub.add_parser("links", help="alpha-beta fits of p2p and collectives per link class",
                        description=links.__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=links.DEFAULT_SIZES,
                   help=f"bytes per rank buffer (default {links.DEFAULT_SIZES})")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per size first")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per size")
    p.add_argument("--out", default=None,
                   help="write the fits as JSON (moeflow.links/1) here (default: print only)")
    add_device_arg(p)
    add_launch_args(p, default_nproc=2)
    p.set_defaults(func=run_links)

    p = bsub.add_parser("a2a", help="all-to-all algorithms over small/medium/large messages "
                                    "(ScheMoE Fig. 9)",
                        description=a2a.__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=a2a.DEFAULT_SIZES,
                   help=f"bytes per rank send buffer (default {a2a.DEFAULT_SIZES})")
    p.add_argument("--algorithms", default=None,
                   help="comma-separated registered names (default: every registered one)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per size first")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per size")
    p.add_argument("--inter-bw", default=None,
                   help="inter-node bandwidth for the bound, e.g. 1gbit (default: none given)")
    p.add_argument("--intra-bw", default=None,
                   help="intra-node bandwidth for the bound (default: none given)")
    p.add_argument("--links", default=None,
                   help="a `bench links --out` file for the bound (default: none)")
    p.add_argument("--out", default=None,
                   help="write the results as JSON here (default: print only)")
    p.add_argument("--plot", default=None,
                   help="write a PNG plot here (needs matplotlib; default: no plot)")
    add_device_arg(p)
    add_launch_args(p, default_nproc=2)
    p.set_defaults(func=run_a2a)


def _check(args, *names) -> list[int]:
    for name in names:
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name} {getattr(args, name)} is invalid: must be >= "
                              f"{0 if name == 'warmup' else 1}")
    try:
        return links.parse_sizes(args.sizes)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def run_links(args: argparse.Namespace) -> int:
    sizes = _check(args, "warmup", "reps")
    if len(sizes) < 2:
        raise ConfigError(f"--sizes {args.sizes!r} is invalid: a fit needs at least 2 sizes")
    res = run_on_ranks(links.links_worker, args, sizes, args.warmup, args.reps, args.device)
    if res is not None:
        print(links.format_table(res["fits"]))
        if args.out:
            save_fits(args.out, res["fits"], {**run_meta(args), "layout": res["layout"]})
            print(f"wrote {args.out}")
    return 0


def run_a2a(args: argparse.Namespace) -> int:
    sizes = _check(args, "warmup", "reps")
    names = None
    if args.algorithms:
        names = [n.strip() for n in args.algorithms.split(",") if n.strip()]
        unknown = [n for n in names if n not in a2a.ALLTOALLS]
        if unknown:
            raise ConfigError(f"--algorithms {unknown} unknown; registered: "
                              f"{', '.join(sorted(a2a.ALLTOALLS))}"
                              f"{did_you_mean(unknown[0], a2a.ALLTOALLS)}")
    bws = a2a.bandwidths(None if args.inter_bw is None else parse_rate(args.inter_bw, "--inter-bw"),
                         None if args.intra_bw is None else parse_rate(args.intra_bw, "--intra-bw"),
                         args.links)
    res = run_on_ranks(a2a.a2a_worker, args, names, sizes, args.warmup, args.reps,
                       args.device)
    if res is not None:
        a2a.add_bounds(res, bws)
        a2a.add_pipe_summary(res, bws, args.links)
        res.update(run_meta(args))
        print(a2a.format_table(res))
        if args.out:
            a2a.write_json(res, args.out)
            print(f"wrote {args.out}")
        if args.plot:
            a2a.plot(res, args.plot)
            print(f"wrote {args.plot}")
    return 0
