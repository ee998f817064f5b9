"""Rank functions for tests/cluster/test_quota.py (importable by spawned ranks): a busy loop of
fixed work, its rate in a rank, and a step where one rank has twice the work of the other."""

from __future__ import annotations

import os
import time


def spin(n: int) -> int:
    """``n`` iterations of pure-Python work (one thread, no allocation, no system calls)."""
    x = 0
    for i in range(n):
        x += i
    return x


def cpu_rate(n: int) -> float:
    """Iterations per second of this process's CPU time: one core's speed, whatever the load."""
    t0 = time.process_time()
    spin(n)
    return n / (time.process_time() - t0)


def rate_worker(n: int, windows: int) -> dict:
    """The rank's cgroup, thread count and its busy loop's best rate over ``windows`` runs of
    ``n`` iterations (iterations per wall second: what its quota lets it do)."""
    import torch

    rates = []
    for _ in range(windows):
        t0 = time.perf_counter()
        spin(n)
        rates.append(n / (time.perf_counter() - t0))
    with open("/proc/self/cgroup") as f:
        cgroup = f.read()
    return {"rate": max(rates), "threads": torch.get_num_threads(), "cgroup": cgroup,
            "in_force": os.environ.get("MOEFLOW_CPU_PER_RANK")}


def step_worker(n_light: int, steps: int, core: int) -> list[tuple[float, float]]:
    """Every rank on CPU ``core``; rank 1 does twice rank 0's work, then all wait for each other.
    Returns ``(own compute, whole step)`` seconds per step (the first, a warm-up, dropped)."""
    import torch.distributed as dist

    os.sched_setaffinity(0, {core})
    work = n_light * (2 if dist.get_rank() == 1 else 1)
    out = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        spin(work)
        t1 = time.perf_counter()
        dist.barrier()
        out.append((t1 - t0, time.perf_counter() - t0))
    return out[1:]


def sleep_worker(seconds: float) -> None:
    time.sleep(seconds)
