"""Inter-node all-to-all bytes of DeepSeek-V3's group-limited routing against plain top-k.

DeepSeek-V3 (section 2.1.2 / 3.2.2, "node-limited routing") makes the expert groups the nodes
(``n_group`` = nodes) so that each token reaches at most ``topk_group`` nodes; SMILE's
bi-level router (``routing/bilevel.py``) gets the same bound from its node router. Run on
several nodes (``moeflow cluster run --nodes 2 --ranks-per-node 2 -- python -m
moeflow.bench.group_limited --out x.json``); variants side by side on the same input, round
robin, with the ``counting`` all-to-all (``direct`` + byte counts):

* ``inter_node_bytes``: bytes this rank's all-to-alls (forward and backward, both
  directions it sends) handed to ranks on other nodes, measured in the exchange;
* ``nodes_per_token``: mean number of distinct other nodes a token's top-k experts live on,
  and ``dedup_inter_node_bytes``: the bytes a dispatch that sends each token once per
  destination node would move (DeepSeek-V3's: IB to the node, then NVLink), computed from the
  routing decisions (moeflow's all-to-alls send one copy per choice and do not deduplicate);
* ``step_ms``: median forward + backward time.
"""

from __future__ import annotations

import argparse
import sys
import json
import statistics
import time
from datetime import timedelta

import torch

from moeflow.config import ConfigError, MoEConfig
from moeflow.layer import MoELayer
from moeflow.topology import Topology


class InterNodeCounter:
    """Wraps a counting all-to-all: bytes sent to ranks of other nodes."""

    def __init__(self, algo, topo: Topology):
        self.algo, self.topo, self.bytes = algo, topo, 0
        start = algo.start

        def counted(x, send_splits, recv_splits, matrix=None):
            row = x[0].numel() * x.element_size() if x.shape[0] else 0
            me = topo.node_rank
            self.bytes += sum(n * row for d, n in enumerate(send_splits)
                              if d // topo.local_size != me)
            return start(x, send_splits, recv_splits, matrix)

        algo.start = counted


def variants(nodes: int) -> list[tuple[str, dict]]:
    ds = dict(router="deepseek_v3", aux_loss_coef=0.0)
    return [("top-k (n_group=1)", dict(ds, router_options=dict(n_group=1, topk_group=1))),
            (f"group-limited (n_group={nodes}, topk_group=1)",
             dict(ds, router_options=dict(n_group=nodes, topk_group=1)))]


def bench(opts: dict) -> dict:
    from moeflow.bench import a2a_count  # noqa: F401  (registers "counting" when run)

    topo = Topology.from_env()
    if topo.num_nodes < 2:
        raise ConfigError("moeflow.bench.group_limited needs several nodes: run it under "
                          "`moeflow cluster run --nodes N ...`")
    E = opts["experts_per_rank"] * topo.world_size
    base = MoEConfig(d_model=opts["d_model"], d_expert=opts["d_expert"], num_experts=E,
                     top_k=opts["top_k"], capacity_factor=None, a2a="counting", seed=1)
    gen = torch.Generator().manual_seed(4000 + topo.rank)
    x = torch.randn(opts["tokens"], opts["d_model"], generator=gen, requires_grad=True)
    rows = []
    layers = []
    for label, v in variants(topo.num_nodes):
        layer = MoELayer(base.replace(**v), topo)
        layers.append((label, v, layer, InterNodeCounter(layer.algo, topo), []))
    per_node = E // topo.num_nodes
    for i in range(opts["warmup"] + opts["reps"]):
        for label, v, layer, counter, times in layers:
            counter.bytes = 0
            torch.distributed.barrier()
            t0 = time.perf_counter()
            layer(x).square().sum().backward()
            torch.distributed.barrier()
            if i >= opts["warmup"]:
                times.append(time.perf_counter() - t0)
    for label, v, layer, counter, times in layers:
        with torch.no_grad():
            experts = layer.router(x.detach()).experts
        nodes = experts // per_node
        other = torch.zeros(x.shape[0], topo.num_nodes, dtype=torch.bool)
        other.scatter_(1, nodes, True)
        other[:, topo.node_rank] = False
        n_other = other.sum(1).double()
        row = opts["d_model"] * x.element_size()
        totals = torch.tensor([counter.bytes, float(n_other.sum()) * row * 4,
                               float(n_other.mean()), 1e3 * statistics.median(times)],
                              dtype=torch.float64)
        gathered = [torch.zeros_like(totals) for _ in range(topo.world_size)]
        torch.distributed.all_gather(gathered, totals)
        g = torch.stack(gathered)
        rows.append({"variant": label, **v,
                     "inter_node_bytes_per_step": float(g[:, 0].sum()),
                     # x4: forward dispatch + combine, backward dispatch + combine
                     "dedup_inter_node_bytes_per_step": float(g[:, 1].sum()),
                     "nodes_per_token_other": float(g[:, 2].mean()),
                     "step_ms_median_slowest": float(g[:, 3].max())})
    return {"nodes": topo.num_nodes, "world": topo.world_size, "opts": opts, "rows": rows}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=256, help="model width")
    p.add_argument("--d-expert", type=int, default=256,
                   help="hidden width of each expert")
    p.add_argument("--experts-per-rank", type=int, default=4,
                   help="experts held by each rank")
    p.add_argument("--top-k", type=int, default=4, help="experts per token")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--reps", type=int, default=5, help="timed steps (median kept)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    """Under torchrun or ``moeflow cluster run``: the variants side by side, rank 0 reports."""
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=300))
    res = bench({k: v for k, v in vars(args).items()
                 if k in ("tokens", "d_model", "d_expert", "experts_per_rank", "top_k",
                          "warmup", "reps", "out")})
    if Topology.from_env().rank == 0:
        for r in res["rows"]:
            print(f"{r['variant']}: inter-node a2a {r['inter_node_bytes_per_step'] / 1e6:.2f} "
                  f"MB/step (dedup per node: {r['dedup_inter_node_bytes_per_step'] / 1e6:.2f} "
                  f"MB), other nodes per token {r['nodes_per_token_other']:.2f}, step "
                  f"{r['step_ms_median_slowest']:.0f} ms")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    torch.distributed.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moeflow.bench.group_limited",
                                description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
