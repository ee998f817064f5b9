"""``moeflow bench layer``: one MoE layer's forward + backward, split into its phases.

For each config: warm-up steps, then timed repetitions (ranks aligned by a barrier before each;
timed with CUDA events on GPUs); a repetition's time is the slowest rank's. Reports medians:
tokens/s over all ranks and milliseconds per phase (route / permute / all_to_all / experts /
combine, forward + backward, as charged by :class:`~moeflow.schedule.phase_timer.PhaseTimer`).

Two more figures per config, from extra untimed steps so they do not disturb the timing:
``host_syncs`` (operations that would make the host wait for a GPU, per forward + backward,
counted by :mod:`moeflow.bench.syncs`; the budget is 0 in padded capacity mode, 1 with trimmed
capacity, ``capacity_padding="auto"``'s choice on CPU, and 1 dropless) and, for
the pipelined schedules (``--schedules``), ``overlap``: the fraction of communication time
during which a computing task ran (:mod:`moeflow.bench.overlap_bench`).

``inter_bytes``: the payload bytes the busiest rank sent over inter-node links in the last
step, forward + backward (``layer.stats["inter_node_bytes"]``; 0 on one node). ``--local-size``
emulates nodes on one machine (ranks per node) and ``--algorithms`` runs every config under
each all-to-all algorithm, so the one-hop ``direct`` can be set against the hierarchical ones;
``node_dedup`` and ``auto`` there are placements (``auto``: the auto-tuner's pick of ``direct``
or ``node_dedup``, tuned before the warm-up and recorded in the row's ``placement`` and
``tuned``).
``--codec NAME`` (``--codec-backward``) runs every config with that codec on its all-to-all
payloads (ScheMoE Section 3's compression), the names unchanged and the codec in each row, so
that ``moeflow simulate layer --codec NAME --measured`` finds every row's twin.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict

import torch

from moeflow.cases.layer_grid import BenchCase, case_config, case_input
from moeflow.layer import MoELayer
from moeflow.schedule.phase_timer import PhaseTimer
from moeflow.bench.overlap_bench import measure_overlap
from moeflow.bench.syncs import step_syncs
from moeflow.measure.timing import slowest, start_aligned
from moeflow.devices import resolve_device
from moeflow.topology import Topology

PHASES = ("route", "permute", "all_to_all", "experts", "combine")


def bench_case(case: BenchCase, topo: Topology, tokens: int, d_model: int, d_expert: int,
               warmup: int, reps: int, device: str | torch.device = "cpu") -> dict:
    cfg = case_config(case, d_model, d_expert)
    layer = MoELayer(cfg, topo).to(device)
    layer.experts.use_grouped_mm = case.grouped_mm
    timer = PhaseTimer()
    x = case_input(tokens, d_model, topo.rank).to(device).requires_grad_()
    if layer.auto_fields:            # placement="auto" (--algorithms auto): tuned untimed
        layer.tune(x)
    totals, phases = [], {p: [] for p in PHASES}
    for i in range(warmup + reps):
        layer.timer = timer
        timer.reset()
        watch = start_aligned(topo, x.device)
        y = layer(x)
        (y.square().mean() + layer.aux_loss).backward()
        elapsed = slowest(watch.stop(), topo)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        if i >= warmup:
            totals.append(elapsed)
            for p in PHASES:
                phases[p].append(slowest(timer.forward.get(p, 0.0)
                                          + timer.backward.get(p, 0.0), topo))
    step = statistics.median(totals)
    # the last timed step's inter-node payload bytes, the busiest rank's
    inter = layer.stats.get("inter_node_bytes")
    inter = None if inter is None else int(slowest(float(inter), topo))
    layer.timer = None
    syncs = step_syncs(layer, x)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    overlap = (measure_overlap(layer, x, warmup=0, reps=reps)
               if case.pipeline_degree > 1 and topo.distributed else None)
    return {**asdict(case), "world_size": topo.world_size, "tokens_per_rank": tokens,
            "host_syncs": sum(syncs.values()), "host_sync_kinds": dict(syncs),
            "overlap": overlap,
            "d_model": d_model, "d_expert": d_expert, "reps": reps,
            "step_ms": 1e3 * step, "tokens_per_s": topo.world_size * tokens / step,
            "phase_ms": {p: 1e3 * statistics.median(v) for p, v in phases.items()},
            "dropped_fraction": layer.stats["dropped_fraction"], "inter_node_bytes": inter,
            # the strategy that ran (--algorithms auto: the tuner's pick) and its measurement
            "placement": layer.cfg.placement,
            "tuned": None if layer.tuned is None else layer.tuned.as_dict()}


def bench_worker(cases: list[BenchCase], tokens: int, d_model: int, d_expert: int,
                 warmup: int, reps: int, device: str = "cpu",
                 local_size: int | None = None) -> list[dict]:
    topo = Topology.from_env(local_size=local_size)
    device = resolve_device(device)
    return [bench_case(c, topo, tokens, d_model, d_expert, warmup, reps, device)
            for c in cases]


def format_table(rows: list[dict]) -> str:
    head = (f"{'config':<36} {'world':>5} {'tok/rank':>8} {'tokens/s':>10} {'ms/step':>8} "
            + " ".join(f"{p:>10}" for p in PHASES) + f" {'dropped':>7} {'syncs':>5} "
            f"{'overlap':>7} {'inter_bytes':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        overlap = "-" if r["overlap"] is None else f"{r['overlap']:.2f}"
        inter = "-" if r.get("inter_node_bytes") is None else str(r["inter_node_bytes"])
        lines.append(f"{r['name']:<36} {r['world_size']:>5} {r['tokens_per_rank']:>8} "
                     f"{r['tokens_per_s']:>10.0f} {r['step_ms']:>8.2f} "
                     + " ".join(f"{r['phase_ms'][p]:>10.2f}" for p in PHASES)
                     + f" {r['dropped_fraction']:>7.3f} {r['host_syncs']:>5} {overlap:>7}"
                     f" {inter:>11}")
    lines.append("phase columns: ms per forward+backward (median); all_to_all includes "
                 "codec work; permute includes planning; syncs: would-be GPU host syncs per "
                 "forward+backward; overlap: fraction of comm time with compute running; "
                 "inter_bytes: payload bytes the busiest rank sent over inter-node links in "
                 "the last step (forward+backward)")
    return "\n".join(lines)


def write_json(rows: list[dict], path: str, command: str,
               cpu_per_rank: float | None = None) -> None:
    """``cpu_per_rank``: the CPU quota per rank in force (None: shared cores)."""
    with open(path, "w") as f:
        json.dump({"command": command, "torch": torch.__version__,
                   "cpu_per_rank": cpu_per_rank, "results": rows}, f, indent=2)
