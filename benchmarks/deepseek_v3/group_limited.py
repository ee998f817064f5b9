"""Inter-node bytes and step time of node-limited routing vs plain top-k, per all-to-all.

DeepSeek-V3's node-limited routing against plain top-k under moeflow's all-to-alls,
``node_dedup`` included, for each node limit M of ``--topk-group`` (DeepSeek-V3 uses M = 4 of
8 nodes).

DeepSeek-V3 (section 2.1.2 / 3.2.2, "node-limited routing") makes the expert groups the nodes
(``n_group`` = nodes) so that each token reaches at most ``topk_group`` nodes; SMILE's
bi-level router (``routing/bilevel_routing.py``) gets the same bound from its node router. The bound
pays off only with a dispatch that sends a token once per destination node (DeepSeek-V3's
IB-then-NVLink dispatch, section 3.2.2): ``a2a="node_dedup"``
(:mod:`moeflow.strategies.node_dedup.strategy`). Run on several nodes (``moeflow cluster run --nodes 2
--ranks-per-node 2 -- python -m moeflow.cli bench group-limited --out x.json``, or
``--local-size`` under torchrun); variants = routing x ``--algorithms``, side by side on the same
input, round robin, dropless. Per variant (``rows``):

* ``inter_node_bytes_per_step``: bytes all ranks handed to ranks of other nodes in one step
  (forward and backward; ``layer.stats["inter_node_bytes"]`` summed over ranks), and
  ``routing_inter_node_bytes_per_step``: the same computed from the routing decisions alone
  (``direct`` / ``counting``: a choice crosses when its expert sits on another node, 4 rows per
  choice over forward and backward; ``node_dedup``: one row per (token, other node), with the
  k gates and k int32 ids on the way out);
* ``nodes_per_token_other``: mean number of distinct other nodes a token's top-k experts live
  on, and ``dedup_inter_node_bytes_per_step``: the token rows alone of a dispatch that sends
  each token once per destination node (without node_dedup's gates and ids);
* ``step_ms``: per timed repetition, forward + backward, the slowest rank's (between two
  barriers), with ``step_ms_median_slowest`` / ``_min`` / ``_max``;
* ``link_bound_ms``: the busiest node's inter-node egress bytes per step over the link rate
  (``--inter-bw``, else the emulated cluster's ``MOEFLOW_CLUSTER_INTER_BW_BPS``): no step can
  be shorter while those bytes go through that node's link.

With both ``direct`` and ``node_dedup``, ``ratios`` holds per routing the paired ratio
``direct / node_dedup`` of the step times of each repetition (measured in the same round) with
its min / median / max. ``auto`` is ``placement="auto"`` (direct, sequential, r = 1 otherwise):
the layer is tuned once before the warm-up (collectively, untimed; the auto-tuner measures
``direct`` and ``node_dedup`` and keeps ``node_dedup`` only where it is faster by more than
its noise margin, docs/autotune.md), its row records the ``placement`` it ran with and the
tuner's measured candidates (``tuned``), and ``ratios`` adds ``auto / direct`` and
``auto / node_dedup`` (step time of the tuner's choice over the forced one, per repetition;
above 1 = the choice is slower) beside whichever of them ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta

import torch

from moeflow.cases.layer_grid import exchange_fields
from moeflow.config import ConfigError, MoEConfig
from moeflow.layer import MoELayer
from moeflow.topology import Topology

# "auto": MoEConfig(placement="auto"), the auto-tuner's pick of direct or node_dedup
ALGORITHMS = ("counting", "direct", "node_dedup", "auto")


def variants(nodes: int, limits: tuple[int, ...] = (1,)) -> list[tuple[str, dict]]:
    """Plain top-k, then node-limited routing with each node limit M (``topk_group``) in
    ``limits``."""
    ds = dict(router="deepseek_v3", aux_loss_coef=0.0)
    return [("top-k (n_group=1)", dict(ds, router_options=dict(n_group=1, topk_group=1)))] + [
        (f"group-limited (n_group={nodes}, topk_group={m})",
         dict(ds, router_options=dict(n_group=nodes, topk_group=m))) for m in limits]


def parse_limits(text: str) -> tuple[int, ...]:
    """``--topk-group``: distinct positive node limits, comma-separated."""
    try:
        limits = tuple(int(a) for a in str(text).split(",") if a.strip())
    except ValueError:
        limits = ()
    if not limits or min(limits) < 1 or len(set(limits)) != len(limits):
        raise ConfigError(f"--topk-group={text!r} is invalid: list distinct positive node "
                          "limits M (DeepSeek-V3's topk_group), e.g. 1,2,4")
    return limits


def parse_algorithms(text: str) -> list[str]:
    algos = [a.strip() for a in str(text).split(",") if a.strip()]
    bad = [a for a in algos if a not in ALGORITHMS]
    if not algos or bad or len(set(algos)) != len(algos):
        raise ConfigError(f"--algorithms={text!r} is invalid: list distinct names out of "
                          f"{', '.join(ALGORITHMS)}, e.g. direct,node_dedup")
    return algos


def _routing_bytes(algo: str, experts: torch.Tensor, per_node: int, node: int, n_nodes: int,
                   k: int, d_model: int, el: int) -> float:
    """Bytes of this rank's tokens that cross node links in one step, from the routing (the
    rows this rank sends and the rows that come back to it: summed over ranks, every row once);
    the formulas of ``tests/multirank/test_inter_node_bytes.py``."""
    nodes = experts // per_node
    if algo != "node_dedup":                  # one row per remote choice, 4 crossings
        return float((nodes != node).sum()) * d_model * el * 4
    pairs = float(_other_nodes(nodes, node, n_nodes).sum())
    # out: token + k gates, k int32 ids, grad of the partial sum; back: partial sum, and the
    # grad of token + gates
    return pairs * (((d_model + k) + d_model) * el + k * 4 + (d_model + (d_model + k)) * el)


def _other_nodes(nodes: torch.Tensor, node: int, n_nodes: int) -> torch.Tensor:
    """(T,) number of distinct nodes other than ``node`` among each token's choices."""
    hit = torch.zeros(nodes.shape[0], n_nodes, dtype=torch.bool)
    hit.scatter_(1, nodes, True)
    hit[:, node] = False
    return hit.sum(1)


def link_rate(given: str | None) -> tuple[float | None, str]:
    from moeflow.bench.a2a import bandwidths
    from moeflow.cluster.shaping import parse_rate
    rate = None if given is None else parse_rate(given, "--inter-bw")
    return bandwidths(rate, None, None)["inter"]


def bench(opts: dict) -> dict:
    from moeflow.bench import a2a_count  # noqa: F401  (registers "counting" when run)

    topo = Topology.from_env(local_size=opts.get("local_size"))
    if topo.num_nodes < 2:
        raise ConfigError("moeflow bench group-limited needs several nodes: run it under "
                          "`moeflow cluster run --nodes N ...` (or pass --local-size)")
    algos = parse_algorithms(opts.get("algorithms") or "counting")
    rate_bps, rate_from = link_rate(opts.get("inter_bw"))
    E = opts["experts_per_rank"] * topo.world_size
    base = MoEConfig(d_model=opts["d_model"], d_expert=opts["d_expert"], num_experts=E,
                     top_k=opts["top_k"], capacity_factor=None, seed=1)
    gen = torch.Generator().manual_seed(4000 + topo.rank)
    x = torch.randn(opts["tokens"], opts["d_model"], generator=gen, requires_grad=True)
    runs = []
    limits = parse_limits(opts.get("topk_group") or "1")
    if max(limits) > topo.num_nodes:
        raise ConfigError(f"--topk-group={opts.get('topk_group')!r} is invalid on "
                          f"{topo.num_nodes} nodes: a token can reach at most every node; "
                          f"use limits up to {topo.num_nodes}")
    for label, v in variants(topo.num_nodes, limits):
        for algo in algos:
            layer = MoELayer(base.replace(**exchange_fields(algo), **v), topo)
            name = label if len(algos) == 1 else f"{label} @ {algo}"
            runs.append(dict(name=name, routing=label, algo=algo, v=v, layer=layer, times=[],
                             sent=[]))
    for r in runs:           # placement="auto": tuned before the warm-up, untimed, in order
        if r["layer"].auto_fields:
            r["layer"].tune(x.detach())
    for i in range(opts["warmup"] + opts["reps"]):
        for r in runs:                                  # round robin: every variant per rep
            torch.distributed.barrier()
            t0 = time.perf_counter()
            r["layer"](x).square().sum().backward()
            torch.distributed.barrier()
            if i >= opts["warmup"]:
                r["times"].append(time.perf_counter() - t0)
                r["sent"].append(float(r["layer"].stats["inter_node_bytes"]))
    per_node = E // topo.num_nodes
    el, reps, P = x.element_size(), opts["reps"], topo.world_size
    rows = []
    for r in runs:
        with torch.no_grad():
            experts = r["layer"].router(x.detach()).experts
        n_other = _other_nodes(experts // per_node, topo.node_rank, topo.num_nodes).double()
        mine = torch.tensor([statistics.median(r["sent"]), float(n_other.sum()) *
                             opts["d_model"] * el * 4, float(n_other.mean()),
                             _routing_bytes(r["layer"].cfg.placement if r["algo"] == "auto"
                                            else r["algo"], experts, per_node, topo.node_rank,
                                            topo.num_nodes, opts["top_k"], opts["d_model"], el),
                             max(r["sent"]) - min(r["sent"]), *r["times"]],
                            dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(P)]
        torch.distributed.all_gather(gathered, mine)
        g = torch.stack(gathered)
        step_ms = [1e3 * float(t) for t in g[:, 5:].max(0).values]
        egress = g[:, 0].view(topo.num_nodes, topo.local_size).sum(1)
        tuned = r["layer"].tuned
        rows.append({"variant": r["name"], "routing": r["routing"], "algorithm": r["algo"],
                     **r["v"],
                     # the strategy that ran (auto: the tuner's pick) and the tuning
                     "placement": r["layer"].cfg.placement,
                     "tuned": None if tuned is None else tuned.as_dict(),
                     "inter_node_bytes_per_step": float(g[:, 0].sum()),
                     "inter_node_bytes_varied": bool(g[:, 4].max() > 0),
                     "routing_inter_node_bytes_per_step": float(g[:, 3].sum()),
                     # x4: forward dispatch + combine, backward dispatch + combine
                     "dedup_inter_node_bytes_per_step": float(g[:, 1].sum()),
                     "nodes_per_token_other": float(g[:, 2].mean()),
                     "node_egress_bytes_per_step": [float(b) for b in egress],
                     "link_bound_ms": (None if rate_bps is None
                                       else 1e3 * float(egress.max()) * 8 / rate_bps),
                     "step_ms": step_ms,
                     "step_ms_median_slowest": statistics.median(step_ms),
                     "step_ms_min": min(step_ms), "step_ms_max": max(step_ms)})
    ratios = []
    if "direct" in algos and "node_dedup" in algos:
        for label, _ in variants(topo.num_nodes, limits):
            a, b = (next(w for w in rows if w["routing"] == label and w["algorithm"] == n)
                    for n in ("direct", "node_dedup"))
            paired = [s / t for s, t in zip(a["step_ms"], b["step_ms"])]
            ratios.append({"routing": label, "over": "direct / node_dedup step time, per rep",
                           "paired": paired, "min": min(paired),
                           "median": statistics.median(paired), "max": max(paired),
                           "bytes_ratio": (a["inter_node_bytes_per_step"]
                                           / max(1.0, b["inter_node_bytes_per_step"]))})
    if "auto" in algos:
        for label, _ in variants(topo.num_nodes, limits):
            a = next(w for w in rows if w["routing"] == label and w["algorithm"] == "auto")
            for forced in ("direct", "node_dedup"):
                b = next((w for w in rows if w["routing"] == label
                          and w["algorithm"] == forced), None)
                if b is None:
                    continue
                paired = [s / t for s, t in zip(a["step_ms"], b["step_ms"])]
                ratios.append({"routing": label, "over": f"auto / {forced} step time, per rep",
                               "placement": a["placement"], "paired": paired,
                               "min": min(paired), "median": statistics.median(paired),
                               "max": max(paired)})
    return {"nodes": topo.num_nodes, "world": P, "opts": opts,
            "inter_bw_bps": rate_bps, "inter_bw_from": rate_from, "reps": reps,
            "rows": rows, "ratios": ratios}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=256, help="model width")
    p.add_argument("--d-expert", type=int, default=256,
                   help="hidden width of each expert")
    p.add_argument("--experts-per-rank", type=int, default=4,
                   help="experts held by each rank")
    p.add_argument("--top-k", type=int, default=4, help="experts per token")
    p.add_argument("--algorithms", default="counting",
                   help="all-to-alls to run each routing under, comma-separated, out of "
                        f"{', '.join(ALGORITHMS)} (default counting: direct + byte counts); "
                        "direct,node_dedup adds their paired step-time ratio; auto: "
                        "placement='auto', the tuner's pick of the two, with its ratio to "
                        "each forced one (direct,node_dedup,auto)")
    p.add_argument("--topk-group", default="1",
                   help="node limits M to run node-limited routing with (DeepSeek-V3's "
                        "topk_group, the expert groups being the nodes), comma-separated, "
                        "e.g. 1,2,4 (default 1)")
    p.add_argument("--inter-bw", default=None,
                   help="inter-node link rate for the link bound, e.g. 100mbit (default: the "
                        "emulated cluster's setting)")
    p.add_argument("--local-size", type=int, default=None,
                   help="ranks per node (default: torchrun's LOCAL_WORLD_SIZE)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--reps", type=int, default=5, help="timed steps (median kept)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


OPTS = ("tokens", "d_model", "d_expert", "experts_per_rank", "top_k", "algorithms", "topk_group",
        "inter_bw",
        "local_size", "warmup", "reps", "out")


def report(res: dict) -> None:
    for r in res["rows"]:
        bound = "-" if r["link_bound_ms"] is None else f"{r['link_bound_ms']:.0f}"
        print(f"{r['variant']}: inter-node {r['inter_node_bytes_per_step'] / 1e6:.2f} MB/step "
              f"(from routing {r['routing_inter_node_bytes_per_step'] / 1e6:.2f}; one copy per "
              f"node {r['dedup_inter_node_bytes_per_step'] / 1e6:.2f}), other nodes per token "
              f"{r['nodes_per_token_other']:.2f}, step {r['step_ms_median_slowest']:.0f} ms "
              f"[{r['step_ms_min']:.0f}, {r['step_ms_max']:.0f}], link bound {bound} ms")
    for q in res["ratios"]:
        what = q["over"].split(" step time")[0]
        more = (f" (bytes {q['bytes_ratio']:.2f}x)" if "bytes_ratio" in q
                else f" (auto chose {q['placement']})")
        print(f"{q['routing']}: {what} {q['median']:.2f}x "
              f"[{q['min']:.2f}, {q['max']:.2f}]{more}")


def run(args: argparse.Namespace) -> int:
    """Under torchrun or ``moeflow cluster run``: the variants side by side, rank 0 reports."""
    parse_algorithms(args.algorithms)                 # a bad name fails before the ranks meet
    parse_limits(args.topk_group)
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=300))
    res = bench({k: v for k, v in vars(args).items() if k in OPTS})
    if torch.distributed.get_rank() == 0:
        from moeflow.commands.common import run_meta   # command, date, load, commit
        res.update(run_meta())
        report(res)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    torch.distributed.destroy_process_group()
    return 0
