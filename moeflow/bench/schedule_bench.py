"""``moeflow bench schedule``: ScheMoE's ablation (Tables 9-10) and the chooser on one layer.

Variants are timed round-robin (one forward + backward of each per repetition, after warm-up),
so a noisy machine affects them alike; a repetition's time is the slowest rank's; medians are
reported with the speedup over the first variant. ``--choose`` runs the profiler + chooser and
prints its prediction beside the measured time of its choice; ``--trace`` / ``--gantt`` write the
timeline of the last variant (Chrome trace JSON, PNG like the paper's Fig. 5).
"""

from __future__ import annotations

import statistics

import torch

from moeflow.comm.alltoall import ALLTOALLS
from moeflow.config import ConfigError, MoEConfig
from moeflow.layer import MoELayer
from moeflow.schedule.executor import Timeline
from moeflow.measure.timing import slowest, start_aligned
from moeflow.devices import resolve_device
from moeflow.topology import Topology


def ablation_variants(codec: str, multi_node: bool, r: int) -> list[tuple[str, dict]]:
    """Table 9: naive, +codec (Z), +Pipe-A2A (ZP), +OptSche (ZPS); and pipelined vs OptSche."""
    a2a = "pipe" if multi_node else "direct"
    return [("naive", dict(codec="none", a2a="direct")),
            (f"+{codec}", dict(codec=codec, a2a="direct")),
            (f"+{codec}+{a2a}", dict(codec=codec, a2a=a2a)),
            (f"+{codec}+{a2a}+pipelined r={r}",
             dict(codec=codec, a2a=a2a, schedule="pipelined", pipeline_degree=r)),
            (f"+{codec}+{a2a}+optsche r={r}",
             dict(codec=codec, a2a=a2a, schedule="optsche", pipeline_degree=r))]



def step_once(layer: MoELayer, x: torch.Tensor, topo: Topology) -> float:
    """One forward + backward, ranks aligned, timed on ``x``'s device (CUDA events on GPUs);
    the slowest rank's seconds."""
    watch = start_aligned(topo, x.device)
    y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()
    elapsed = slowest(watch.stop(), topo)
    layer.zero_grad(set_to_none=True)
    return elapsed


def time_variants(base: MoEConfig, variants: list[tuple[str, dict]], topo: Topology,
                  x: torch.Tensor, warmup: int, reps: int) -> list[dict]:
    """Median forward + backward time of each variant (round-robin repetitions), the median
    time its all-to-all tasks took (forward + backward, slowest rank) and its strategy's
    ``choice_record()``, layers on ``x``'s device (Parm's measured auto: ``warmup`` >= 1)."""
    layers = [MoELayer(base.replace(**v), topo).to(x.device) for _, v in variants]
    times: list[list[float]] = [[] for _ in variants]
    comm: list[list[float]] = [[] for _ in variants]
    for layer in layers:
        layer.timeline = Timeline()
    for i in range(warmup + reps):
        for layer, ts, cs in zip(layers, times, comm):
            layer.timeline.clear()
            t = step_once(layer, x, topo)
            a2a = sum(r.end - r.start for r in layer.timeline.records if r.task.is_comm)
            if i >= warmup:
                ts.append(t)
                cs.append(slowest(a2a, topo))
    base_ms = 1e3 * statistics.median(times[0])
    out = []
    for (label, v), ts, cs, layer in zip(variants, times, comm, layers):   # Parm: trimmed?
        ms, st, rec = 1e3 * statistics.median(ts), layer.stats, layer.strategy.choice_record()
        out.append({"variant": label, **v, **rec, "step_ms": ms, "speedup": base_ms / ms,
                    "a2a_ms": 1e3 * statistics.median(cs), "samples_ms": [1e3 * t for t in ts],
                    **({"trimmed": bool(st["parm_trimmed"])} if "parm_trimmed" in st else {})})
    for layer in layers:
        layer.lane.close()
    return out


def usable_algorithms(topo: Topology) -> list[str]:
    ok = []
    for name, cls in sorted(ALLTOALLS.items()):
        try:
            cls.check_topology(topo)
            ok.append(name)
        except ConfigError:
            pass
    return ok


def bench_worker(opts: dict) -> dict:
    topo = Topology.from_env()
    base = MoEConfig(d_model=opts["d_model"], d_expert=opts["d_expert"],
                     num_experts=opts["experts_per_rank"] * topo.ep_size, top_k=opts["top_k"],
                     capacity_factor=opts["capacity_factor"], seed=1)
    device = resolve_device(opts.get("device", "cpu"))
    gen = torch.Generator().manual_seed(2000 + topo.rank)
    x = torch.randn(opts["tokens"], opts["d_model"], generator=gen).to(device)
    variants = ablation_variants(opts["codec"], topo.num_nodes > 1, opts["r"])
    rows = time_variants(base, variants, topo, x, opts["warmup"], opts["reps"])
    result = {"topology": repr(topo), "rows": rows, "config": vars(base).copy()}
    if opts.get("choose"):
        from moeflow.schedule.chooser import choose, explain

        best, cands, _ = choose(lambda c, a: MoELayer(base.replace(codec=c, a2a=a),
                                                      topo).to(device), x,
                                ["none", opts["codec"]], usable_algorithms(topo), [1, 2, 4],
                                ["sequential", "pipelined", "optsche"], reps=opts["reps"])
        measured = time_variants(base, [("chosen", dict(
            codec=best.codec, a2a=best.a2a, schedule=best.schedule,
            pipeline_degree=best.pipeline_degree))], topo, x, opts["warmup"], opts["reps"])
        result["choice"] = {"candidates": [vars(c) for c in cands], "explain": explain(cands),
                            "best": vars(best), "measured_ms": measured[0]["step_ms"]}
    if opts.get("trace") or opts.get("gantt"):
        layer = MoELayer(base.replace(**variants[-1][1]), topo).to(device)
        step_once(layer, x, topo)
        layer.timeline = Timeline()
        step_once(layer, x, topo)
        if topo.rank == 0:
            from moeflow.schedule.trace import chrome_trace, gantt_png

            if opts.get("trace"):
                chrome_trace(layer.timeline.records, opts["trace"])
            if opts.get("gantt"):
                gantt_png(layer.timeline.records, opts["gantt"], variants[-1][0])
    return result


def format_result(res: dict) -> str:
    lines = [res["topology"],
             f"{'variant':<34} {'ms/step':>9} {'speedup':>8} {'a2a ms':>8}", "-" * 62]
    for r in res["rows"]:
        lines.append(f"{r['variant']:<34} {r['step_ms']:>9.2f} {r['speedup']:>7.2f}x "
                     f"{r['a2a_ms']:>8.2f}")
    if "choice" in res:
        c = res["choice"]
        lines += ["", "chooser (prediction from profiled fits, two-lane model):", c["explain"],
                  f"chosen: {c['best']['codec']} / {c['best']['a2a']} / "
                  f"{c['best']['schedule']} r={c['best']['pipeline_degree']}: predicted "
                  f"{c['best']['predicted_s'] * 1e3:.2f} ms, measured {c['measured_ms']:.2f} ms"]
    return "\n".join(lines)
