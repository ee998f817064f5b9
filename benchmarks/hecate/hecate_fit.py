"""``moeflow bench hecate-fit``: peak memory per rank of a whole training step under EP, FSSDP
and FSSDP-RM, and the largest batch each mode fits under one per-rank memory budget (HECATE
Section 5.3: Fig. 13's peak memory by parameters / gradients / optimizer state, Fig. 14's
"largest batch size that did not cause an out-of-memory error"; Section 3.2's
re-materialization, which frees each layer's materialized experts after its forward).

The model, skew and step are :mod:`benchmarks.hecate.hecate_model`'s (a GPT of several MoE
layers, Zipf-skewed dropless routing, AdamW). Each mode is a fresh launch of ``nproc`` gloo
ranks (this machine's CPUs), the modes one after the other.

**What is measured, per rank, per step** (CPU: torch has no allocator statistics):

* ``peak``: the process's peak resident set during the step (``VmHWM`` of ``/proc/self/status``,
  reset to the current resident set before the step by writing ``5`` to
  ``/proc/self/clear_refs``), minus the resident set before the model was built (imports,
  process group: the same in every mode). So it counts the parameters, gradients, optimizer
  state, materialized experts, activations and the step's transients, as they were resident.
  The ranks run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB (set here before the
  launch), so every large tensor is its own mapping, returned to the system when freed: the
  resident set follows the live tensors instead of the allocator's cache, and a probe is not
  charged for an earlier, larger one (``malloc_trim`` too, before each probe).
* a breakdown (not the budget): ``forward_growth``, the resident set at the end of the forward
  minus at the start of the step (the activations kept for the backward, the materialized
  experts held, the forward's transients still mapped); counted bytes of the parameters,
  gradients and AdamW state after the step and of the materialized experts held at the end of
  the forward (:func:`benchmarks.hecate.hecate_model.train_step`).

**The budget**: ``--budget-mib`` per rank, checked against ``peak`` of the most loaded rank
(a step "fits" when every rank's ``peak`` is at most the budget: nothing is enforced, an
out-of-memory error is what exceeding it would be). **The search** per mode: ``--warmup``
steps at the first batch (Adam state, Algorithm 1's load window), then batch sizes (sequences
per rank) 1, 2, 4, ... while they fit (up to ``--max-batch``), then bisection between the
largest fitting and the smallest failing size; every probe is ``--probe-steps`` steps at that
size, the last one measured.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.distributed as dist

from benchmarks.hecate.hecate_model import build, train_step
from benchmarks.training.train_steps import status_bytes
from moeflow.topology import Topology

MMAP_THRESHOLD = 65536


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def search(probe, budget: int, start: int, max_batch: int) -> tuple[int, list[dict]]:
    """Doubling from ``start`` while ``probe(b)["peak"] <= budget`` (up to ``max_batch``), then
    bisection: (the largest fitting batch, 0 if none; every probe's record in order)."""
    records: list[dict] = []

    def fits(b: int) -> bool:
        rec = probe(b)
        rec["batch"], rec["fits"] = b, rec["peak"] <= budget
        records.append(rec)
        return rec["fits"]

    lo, hi, b = 0, None, start
    while b <= max_batch:
        if fits(b):
            lo, b = b, 2 * b
        else:
            hi = b
            break
    if hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    return lo, records


def fit_worker(opts: dict, mode: str) -> dict:
    """One mode on every rank: warm up, search the batch, report every probe (rank 0's view of
    the slowest / largest rank)."""
    topo = Topology.from_env()
    torch.manual_seed(0)
    before = status_bytes("VmRSS")
    model, opt = build(opts["preset"], opts["overrides"], mode, opts["zipf"], topo)
    step = 0
    for _ in range(opts["warmup"]):
        train_step(model, opt, opts["start_batch"], topo, step)
        step += 1

    def probe(b: int) -> dict:
        nonlocal step
        for _ in range(opts["probe_steps"] - 1):
            train_step(model, opt, b, topo, step)
            step += 1
        _trim()
        dist.barrier()
        _reset_peak()
        start = status_bytes("VmRSS")
        rec = train_step(model, opt, b, topo, step, measure=True, after_forward=lambda: {
            "forward_growth": status_bytes("VmRSS") - start})
        step += 1
        peak = status_bytes("VmHWM")
        mine = {**{k: v for k, v in rec.items() if k != "tokens_per_rank"},
                "peak": peak - before, "rss_start": start - before}
        every = [None] * topo.world_size
        dist.all_gather_object(every, mine, group=topo.world_group)
        tokens = rec["tokens_per_rank"]
        return {"peak": max(r["peak"] for r in every),
                "per_rank": {k: [r[k] for r in every] for k in mine},
                "max_tokens_per_rank": [max(t) for t in tokens],
                "max_over_mean": [max(t) / (sum(t) / len(t)) for t in tokens]}

    largest, records = search(probe, opts["budget"], opts["start_batch"], opts["max_batch"])
    for m in model.moe_layers():
        m.lane.close()
    return {"mode": mode, "largest_batch": largest, "probes": records,
            "rss_before_model": before}


def run(opts: dict, nproc: int, timeout_s: float) -> dict:
    """Every mode in its own launch of ``nproc`` local ranks."""
    from moeflow.launch import launch_local

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)   # read by the ranks' libc
    rows = []
    for mode in opts["modes"]:
        got = launch_local(fit_worker, nproc, opts, mode, timeout_s=timeout_s)
        rows.append(got[0])
        print(format_row(got[0]), flush=True)
    return {"options": opts, "nproc": nproc, "load_avg_end": os.getloadavg(),
            "memory_source": "peak: VmHWM during the step (reset by /proc/self/clear_refs) "
                             "minus VmRSS before the model was built, the largest rank; "
                             f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}",
            "rows": rows}


def _mib(n: float) -> float:
    return n / 2**20


def format_row(r: dict) -> str:
    lines = [f"{r['mode']}: largest batch {r['largest_batch']}"]
    for p in r["probes"]:
        pr = p["per_rank"]
        lines.append(
            f"  batch {p['batch']:>4} peak {_mib(p['peak']):8.1f} MiB "
            f"{'fits' if p['fits'] else 'over'}; (max rank) forward growth "
            f"{_mib(max(pr['forward_growth'])):7.1f} mat {_mib(max(pr['materialized_held'])):6.1f}"
            f" P/G/O {_mib(max(pr['params'])):.1f}/{_mib(max(pr['grads'])):.1f}/"
            f"{_mib(max(pr['optimizer'])):.1f}; max/mean tokens "
            + " ".join(f"{v:.2f}" for v in p["max_over_mean"]))
    return "\n".join(lines)


def format_result(res: dict) -> str:
    budget = res["options"]["budget"]
    lines = [f"budget {_mib(budget):.1f} MiB per rank (peak resident set added by the step)"]
    lines += [f"  {r['mode']:<34} largest batch {r['largest_batch']}" for r in res["rows"]]
    return "\n".join(lines)


__all__ = ["fit_worker", "format_result", "run", "search"]
