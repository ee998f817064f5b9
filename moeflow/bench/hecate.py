"""``moeflow bench hecate``: one MoE layer under skewed loads, EP against FSSDP (HECATE).

Loads are skewed Zipf-like: every token carries a constant feature whose router weights are
``s * log(1 / rank_e)`` (expert ``e``'s popularity rank, a fixed shuffle), so the router's
softmax favours expert ``e`` by ``rank_e^-s`` on top of the random part; the measured loads
(max / mean tokens per rank) are reported, not assumed. Variants, timed round-robin on the same
input (forward + backward + gradient sync; ranks aligned; the slowest rank's time; median):

* ``ep``: static expert parallelism;
* ``fssdp static``: FSSDP storage with ``P' = P`` (EP's data flow plus the storage's copies);
* ``fssdp alg1``: Algorithm 1 on the load window (``t``, ``m`` given), spAG on the critical
  path (a bare layer has no attention to hide it behind);
* ``fssdp alg1 rm``: the same with re-materialization (a second spAG in the backward).

Bytes: the spAG / spRS bytes of all ranks for the last ``P'``, next to Eq. 2's all-reduce
volume for the same placement (``comm.sparse.allreduce_volume``, per group member).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import torch

from moeflow.bench.timing import slowest, start_aligned
from moeflow.comm.sparse import allreduce_volume
from moeflow.config import MoEConfig
from moeflow.layer import MoELayer
from moeflow.parallel.grad_sync import sync_gradients
from moeflow.placement.layer_experts import FSSDPExperts
from moeflow.topology import Topology


def variants(t: int, m: int) -> list[tuple[str, dict]]:
    alg1 = dict(materialize="sparse", overlap_degree=t, memory_capacity=m)
    return [("ep", {}),
            ("fssdp static", dict(placement="fssdp")),
            ("fssdp alg1", dict(placement="fssdp", fssdp=alg1)),
            ("fssdp alg1 rm", dict(placement="fssdp", fssdp={**alg1, "rematerialize": True}))]


def skew(layer: MoELayer, s: float) -> None:
    """Router weights of feature 0 (constant 1 in the input): ``-s * log(rank_e)``."""
    E = layer.cfg.num_experts
    ranks = np.random.default_rng(7).permutation(E) + 1
    with torch.no_grad():
        layer.router.weight[0] = torch.tensor(-s * np.log(ranks), dtype=layer.router.weight.dtype)


def _step(layer: MoELayer, x: torch.Tensor, topo: Topology) -> float:
    watch = start_aligned(topo, x.device)
    y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()
    sync_gradients(layer, topo)
    elapsed = slowest(watch.stop(), topo)
    layer.zero_grad(set_to_none=True)
    return elapsed


def bench_worker(opts: dict) -> dict:
    topo = Topology.from_env()
    E = opts["experts_per_rank"] * topo.world_size
    rows = []
    for s in opts["zipf"]:
        base = MoEConfig(d_model=opts["d_model"], d_expert=opts["d_expert"], num_experts=E,
                         top_k=opts["top_k"], capacity_factor=None, aux_loss_coef=0.0, seed=1)
        vs = variants(opts["t"], opts["m"])
        layers = [MoELayer(base.replace(**v), topo) for _, v in vs]
        for layer in layers:
            skew(layer, s)
        gen = torch.Generator().manual_seed(4000 + topo.rank)
        x = torch.randn(opts["tokens"], opts["d_model"], generator=gen)
        x[:, 0] = 1.0
        times: list[list[float]] = [[] for _ in vs]
        for i in range(opts["warmup"] + opts["reps"]):
            for layer, ts in zip(layers, times):
                t = _step(layer, x, topo)
                if i >= opts["warmup"]:
                    ts.append(t)
        ep_ms = 1e3 * statistics.median(times[0])
        static_loads = layers[1].experts.last_loads
        for (label, v), layer, ts in zip(vs, layers, times):
            ms = 1e3 * statistics.median(ts)
            ex = layer.experts
            loads = ex.last_loads if isinstance(ex, FSSDPExperts) else static_loads
            row = {"zipf_s": s, "variant": label, "step_ms": ms, "speedup_vs_ep": ep_ms / ms,
                   "samples_ms": [1e3 * t for t in ts],
                   "max_tokens_per_rank": int(loads.max()),
                   "max_over_mean": float(loads.max() / loads.mean()),
                   "tokens_per_rank": [int(n) for n in loads]}
            if isinstance(ex, FSSDPExperts):
                st = ex.stats()
                holders = ex.last_placement.holder_chunks()
                row.update(spag_bytes=st["spag_bytes_all_ranks"],
                           sprs_bytes=st["sprs_bytes_all_ranks"],
                           eq2_allreduce_bytes_per_member=allreduce_volume(holders,
                                                                          ex.expert_bytes),
                           eq2_allreduce_bytes_all_members=sum(
                               2 * (len(h) - 1) * ex.expert_bytes for h in holders
                               if len(h) > 1),
                           replicas=sum(len(h) - 1 for h in holders))
            rows.append(row)
        for layer in layers:
            layer.lane.close()
    return {"topology": repr(topo), "options": opts, "rows": rows}


def format_result(res: dict) -> str:
    lines = [res["topology"],
             f"{'zipf s':>6} {'variant':<15} {'ms/step':>9} {'vs ep':>7} {'max tok':>8} "
             f"{'max/mean':>8} {'spAG+spRS B':>12} {'Eq.2 B':>12}", "-" * 86]
    for r in res["rows"]:
        sp = r.get("spag_bytes", math.nan) + r.get("sprs_bytes", math.nan)
        eq2 = r.get("eq2_allreduce_bytes_all_members", math.nan)
        lines.append(f"{r['zipf_s']:>6} {r['variant']:<15} {r['step_ms']:>9.2f} "
                     f"{r['speedup_vs_ep']:>6.2f}x {r['max_tokens_per_rank']:>8} "
                     f"{r['max_over_mean']:>8.2f} {sp:>12.0f} {eq2:>12.0f}")
    return "\n".join(lines)


__all__ = ["bench_worker", "format_result", "skew", "variants"]
