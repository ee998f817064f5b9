"""``moeflow cluster run|cleanup``: an emulated multi-node cluster on one machine (needs root)."""

from __future__ import annotations

import argparse

from moeflow.cluster.launcher import ClusterSpec, run_cluster
from moeflow.cluster.netns import ClusterError, cleanup_leftovers
from moeflow.cluster.quota import CpuQuota, cleanup_stale, parse_cpu_per_rank
from moeflow.errors import ConfigError
from moeflow.cluster.shaping import LinkShape, parse_latency, parse_rate


def register(sub) -> None:
    p = sub.add_parser("cluster", help="emulated multi-node cluster on this machine (root)")
    csub = p.add_subparsers(dest="cluster", required=True, metavar="ACTION")
    run = csub.add_parser(
        "run", help="run COMMAND as a torchrun job over N emulated nodes",
        description="Creates N network namespaces (nodes) joined by links limited with tc, "
                    "starts torchrun in each (static rendezvous on node 0) and runs COMMAND on "
                    "every rank; removes everything afterwards. Example: moeflow cluster run "
                    "--nodes 2 --ranks-per-node 2 --inter-bw 1gbit -- python -m moeflow.cli "
                    "bench links --out links.json")
    run.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    run.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node")
    run.add_argument("--inter-bw", default="1gbit",
                     help="bandwidth of each node's link, each direction (tc units: 1gbit, "
                          "100mbit; 'none' = unlimited; default 1gbit)")
    run.add_argument("--inter-latency", default=None,
                     help="one-way latency added on each link direction (e.g. 200us; needs "
                          "netem; default: none)")
    run.add_argument("--intra-bw", default=None,
                     help="limit each node's loopback too (default: unlimited)")
    run.add_argument("--intra-latency", default=None,
                     help="latency added on loopback (netem; default: none)")
    run.add_argument("--mtu", type=int, default=1500, help="MTU of the inter-node links")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="passed to torchrun: restart every rank up to this many times after "
                          "one fails (moeflow train resumes from its latest checkpoint)")
    run.add_argument("--cpu-per-rank", default="none", metavar="X",
                     help="GPU-like mode: hold each rank to X cores (e.g. 0.45) with a CFS quota "
                          "in a CPU cgroup of its own (10 ms period; torch threads per rank = "
                          "ceil(X)), so a rank with more work takes longer as on its own device; "
                          "auto = 0.9 x cores / ranks; none = ranks share the cores (default: "
                          "none). A quota models a device, not a GPU (docs/benchmarks/cluster.md)")
    run.add_argument("command", nargs=argparse.REMAINDER,
                     help="after --: the command every rank runs, e.g. python train.py")
    run.set_defaults(func=run_run)
    clean = csub.add_parser("cleanup", help="remove namespaces and CPU cgroups left by emulated "
                                            "runs (and --cpu-per-rank launches) that died")
    clean.add_argument("--all", action="store_true",
                       help="also remove those of runs still alive")
    clean.set_defaults(func=run_cleanup)


def _shape(bw: str | None, latency: str | None, what: str) -> LinkShape:
    rate = None if bw is None or bw.lower() in ("none", "unlimited") else parse_rate(
        bw, f"--{what}-bw")
    lat = None if latency is None else parse_latency(latency, f"--{what}-latency")
    return LinkShape(rate_bps=rate, latency_s=lat)


def run_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        spec = ClusterSpec(args.nodes, args.ranks_per_node,
                           inter=_shape(args.inter_bw, args.inter_latency, "inter"),
                           intra=_shape(args.intra_bw, args.intra_latency, "intra"),
                           mtu=args.mtu, max_restarts=args.max_restarts,
                           quota=CpuQuota(parse_cpu_per_rank(
                               args.cpu_per_rank, args.nodes * args.ranks_per_node)))
        return run_cluster(spec, command)
    except (ClusterError, ConfigError) as err:
        raise SystemExit(f"moeflow cluster run: error: {err}")


def run_cleanup(args: argparse.Namespace) -> int:
    try:
        removed = cleanup_leftovers(include_live=args.all)
        groups = cleanup_stale(include_live=args.all)
    except (ClusterError, OSError) as err:
        raise SystemExit(f"moeflow cluster cleanup: error: {err}")
    print(f"removed {len(removed)} namespace(s)" + "".join(f"\n  {n}" for n in removed))
    print(f"removed {len(groups)} CPU cgroup(s)" + "".join(f"\n  {g}" for g in groups))
    return 0
