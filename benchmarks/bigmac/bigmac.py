"""``moeflow bench bigmac``: fine-grained vs BigMac (and vanilla) MoE layers, side by side.

For every top-k and structure, one MoE layer's forward + backward is timed on every rank
(warm-up, then repetitions aligned by a barrier and interleaved over the cases; a repetition's
time is the slowest rank's; medians and minima; the process CPU time summed over ranks is
reported too, as with ``--threads 1`` it is less sensitive to other jobs sharing the cores),
split into phases (``project`` is BigMac's two projections), and the bytes the layer hands to
the all-to-all in one step are counted by the ``counting`` algorithm
(:mod:`moeflow.bench.a2a_count`) and compared with the formula of
:mod:`moeflow.models.cost` (``4 k w`` elements per token for dropless routing). The paper's
claim under test: BigMac moves ``r`` times the fine-grained bytes, and is faster where the
all-to-all dominates (BigMac Fig. 3-4: 1.5-3.1x), at the price of two small projections.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict

import torch

from moeflow.bench import a2a_count  # noqa: F401  (registers "counting")
from moeflow.measure.timing import slowest, start_aligned
from moeflow.cases.structures import StructureCase, case_config, case_input, expected_a2a_bytes
from moeflow.devices import host_all_reduce, resolve_device
from moeflow.experts.structure import comm_width
from moeflow.layer import MoELayer
from moeflow.schedule.phase_timer import PhaseTimer
from moeflow.topology import Topology

PHASES = ("route", "project", "permute", "all_to_all", "experts", "combine")


class _Runner:
    """One case on this rank: its layer, input, timer and collected samples."""

    def __init__(self, case: StructureCase, topo: Topology, tokens: int, d_model: int,
                 device: torch.device):
        self.case, self.topo, self.tokens = case, topo, tokens
        self.cfg = case_config(case, d_model)
        self.layer = MoELayer(self.cfg, topo).to(device)
        self.timer = PhaseTimer()
        self.x = case_input(tokens, d_model, topo.rank).to(device).requires_grad_()
        self.totals: list[float] = []
        self.cpu: list[float] = []                  # process CPU seconds, summed over ranks
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self.counted: tuple[int, int, int] | None = None

    def step(self, record: bool) -> None:
        layer, x, topo, timer = self.layer, self.x, self.topo, self.timer
        layer.timer = timer
        timer.reset()
        layer.algo.reset()
        watch = start_aligned(topo, x.device)
        c0 = time.process_time()
        y = layer(x)
        (y.square().mean() + layer.aux_loss).backward()
        seconds = watch.stop()                      # waits for the device on CUDA
        cpu = time.process_time() - c0
        elapsed = slowest(seconds, topo)
        if self.counted is None:
            self.counted = (layer.algo.payload_bytes, layer.algo.offrank_bytes)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        if record:
            self.totals.append(elapsed)
            self.cpu.append(_sum(cpu, topo))
            for p in PHASES:
                self.phases[p].append(slowest(timer.forward.get(p, 0.0)
                                               + timer.backward.get(p, 0.0), topo))

    def result(self) -> dict:
        topo, cfg, case = self.topo, self.cfg, self.case
        payload, offrank, all_tokens, expect = host_all_reduce(
            [float(v) for v in self.counted]
            + [float(self.tokens),
               float(expected_a2a_bytes(cfg, self.tokens, self.x.element_size()))],
            "sum", topo.world_group)
        step = statistics.median(self.totals)
        return {**asdict(case), "name": case.name, "capacity_factor": cfg.capacity_factor,
                "world_size": topo.world_size, "tokens_per_rank": self.tokens,
                "d_model": cfg.d_model, "comm_width": comm_width(cfg),
                "reps": len(self.totals), "step_ms": 1e3 * step,
                "step_ms_all": [1e3 * t for t in self.totals],
                "cpu_ms": 1e3 * statistics.median(self.cpu),
                "cpu_ms_min": 1e3 * min(self.cpu), "step_ms_min": 1e3 * min(self.totals),
                "cpu_ms_all": [1e3 * t for t in self.cpu],
                "tokens_per_s": topo.world_size * self.tokens / step,
                "phase_ms": {p: 1e3 * statistics.median(v) for p, v in self.phases.items()},
                "a2a_bytes_per_token": payload / all_tokens,
                "a2a_offrank_bytes_per_token": offrank / all_tokens,
                "a2a_expected_bytes_per_token": expect / all_tokens,
                "a2a_bytes_match": payload == expect,
                "params": sum(p.numel() for p in self.layer.parameters())}


def _sum(value: float, topo: Topology) -> float:
    return host_all_reduce([value], "sum", topo.world_group)[0]


def bench_worker(cases: list[StructureCase], tokens: int, d_model: int, warmup: int,
                 reps: int, device: str = "cpu", threads: int | None = None
                 ) -> list[dict] | None:
    """Interleaved: each repetition runs every case once, so load drifts hit all alike.
    ``threads``: intra-op CPU threads per rank (None: as launched)."""
    if threads is not None:
        torch.set_num_threads(threads)
    topo = Topology.from_env()
    device = resolve_device(device)
    torch.manual_seed(0)
    runners = [_Runner(c, topo, tokens, d_model, device) for c in cases]
    for i in range(warmup + reps):
        for r in runners:
            r.step(record=i >= warmup)
    rows = [r.result() for r in runners]
    return rows if topo.rank == 0 else None          # one table per job, under torchrun too


def _speedups(rows: list[dict]) -> dict[int, dict[str, float]]:
    """Fine-grained step time / BigMac step time per top-k: ratio of the medians, and the
    median of the per-repetition ratios (the two ran back to back in each repetition)."""
    out = {}
    for r in rows:
        if r["structure"] != "bigmac":
            continue
        fine = [f for f in rows if f["structure"] == "fine_grained" and f["top_k"] == r["top_k"]]
        if fine:
            pairs = [a / b for a, b in zip(fine[0]["step_ms_all"], r["step_ms_all"])]
            out[r["top_k"]] = {"ratio_of_medians": fine[0]["step_ms"] / r["step_ms"],
                               "cpu_ratio_of_medians": fine[0]["cpu_ms"] / r["cpu_ms"],
                               "cpu_ratio_of_mins": fine[0]["cpu_ms_min"] / r["cpu_ms_min"],
                               "median_paired_ratio": statistics.median(pairs),
                               "paired_min": min(pairs), "paired_max": max(pairs)}
    return out


def format_table(rows: list[dict]) -> str:
    head = (f"{'config':<26} {'world':>5} {'a2a w':>5} {'ms/step':>9} {'cpu ms':>8} "
            + " ".join(f"{p:>10}" for p in PHASES)
            + f" {'A2A B/tok':>10} {'expected':>10} {'match':>5} {'off-rank':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['name']:<26} {r['world_size']:>5} {r['comm_width']:>5} "
                     f"{r['step_ms']:>9.2f} {r['cpu_ms']:>8.1f} "
                     + " ".join(f"{r['phase_ms'][p]:>10.2f}" for p in PHASES)
                     + f" {r['a2a_bytes_per_token']:>10.0f} "
                     f"{r['a2a_expected_bytes_per_token']:>10.0f} "
                     f"{'yes' if r['a2a_bytes_match'] else 'NO':>5} "
                     f"{r['a2a_offrank_bytes_per_token']:>9.0f}")
    for k, s in sorted(_speedups(rows).items()):
        lines.append(f"top-{k}: BigMac speedup over fine-grained (fine ms / BigMac ms): "
                     f"{s['ratio_of_medians']:.2f}x of medians, {s['median_paired_ratio']:.2f}x "
                     f"median per repetition (range {s['paired_min']:.2f}-{s['paired_max']:.2f}); "
                     f"CPU time {s['cpu_ratio_of_medians']:.2f}x of medians, "
                     f"{s['cpu_ratio_of_mins']:.2f}x of minima")
    lines.append("ms/step: wall clock of the slowest rank; cpu ms: process CPU time summed over "
                 "ranks (less sensitive to other load on the machine); both medians")
    lines.append("phase columns: ms per forward+backward (median of the slowest rank); A2A B/tok: "
                 "bytes handed to the all-to-all per token (fwd+bwd, dispatch+combine), counted; "
                 "expected: the formula; off-rank: the part sent to other ranks")
    return "\n".join(lines)


def write_json(rows: list[dict], path: str, command: str,
               cpu_per_rank: float | None = None) -> None:
    """``cpu_per_rank``: the CPU quota per rank in force (None: shared cores)."""
    with open(path, "w") as f:
        json.dump({"command": command, "torch": torch.__version__, "cpu_per_rank": cpu_per_rank,
                   "cluster_links_bps": {k: v for k, v in os.environ.items()
                                         if k.startswith("MOEFLOW_CLUSTER_")},
                   "results": rows,
                   "speedup_fine_over_bigmac": _speedups(rows)}, f, indent=2)
