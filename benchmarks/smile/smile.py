"""``moeflow bench smile``: SMILE's layer profile (section 4.4, Fig. 9 / Table 3): layer time and
all-to-all time of bi-level routing against flat top-1 routing (Switch), side by side.

Variants, timed round-robin on the same input: Switch (top-1 over all experts, ``direct``
all-to-all), Switch with the two-stage all-to-all (isolates the communication change), and
SMILE (bi-level router, two-stage all-to-all). Needs several nodes (``moeflow cluster run``).
"""

from __future__ import annotations

import torch

from moeflow.bench.schedule_bench import time_variants
from moeflow.config import ConfigError, MoEConfig
from moeflow.devices import resolve_device
from moeflow.topology import Topology


def smile_variants(nodes: int) -> list[tuple[str, dict]]:
    return [("switch top-1, direct", dict(router="topk", a2a="direct")),
            ("switch top-1, bilevel a2a", dict(router="topk", a2a="bilevel")),
            ("smile bi-level, bilevel a2a", dict(router="bilevel", bilevel_nodes=nodes,
                                                 a2a="bilevel"))]


def bench_worker(opts: dict) -> dict:
    topo = Topology.from_env()
    if topo.num_nodes < 2:
        raise ConfigError("moeflow bench smile needs several nodes: run it under "
                          "`moeflow cluster run --nodes N ...` or torchrun on N nodes")
    base = MoEConfig(d_model=opts["d_model"], d_expert=opts["d_expert"],
                     num_experts=opts["experts_per_rank"] * topo.world_size, top_k=1,
                     capacity_factor=opts["capacity_factor"], aux_loss_coef=0.005, seed=1)
    device = resolve_device(opts.get("device", "cpu"))
    rows = []
    for tokens in opts["tokens"]:
        gen = torch.Generator().manual_seed(3000 + topo.rank)
        x = torch.randn(tokens, opts["d_model"], generator=gen).to(device)
        for row in time_variants(base, smile_variants(topo.num_nodes), topo, x,
                                 opts["warmup"], opts["reps"]):
            row["tokens_per_rank"] = tokens
            row["a2a_bytes_per_rank"] = tokens * opts["d_model"] * 4
            rows.append(row)
    return {"topology": repr(topo), "rows": rows}


def format_result(res: dict) -> str:
    lines = [res["topology"], f"{'tokens':>7} {'variant':<30} {'ms/step':>9} {'a2a ms':>8} "
                              f"{'vs switch':>9} {'a2a vs switch':>13}", "-" * 82]
    base: dict[int, dict] = {}
    for r in res["rows"]:
        b = base.setdefault(r["tokens_per_rank"], r)
        lines.append(f"{r['tokens_per_rank']:>7} {r['variant']:<30} {r['step_ms']:>9.2f} "
                     f"{r['a2a_ms']:>8.2f} {b['step_ms'] / r['step_ms']:>8.2f}x "
                     f"{b['a2a_ms'] / r['a2a_ms']:>12.2f}x")
    return "\n".join(lines)
