"""Timing ``Trainer.train_step`` between barriers and reading this process's memory from
``/proc``: shared by ``moeflow bench recompute`` and ``moeflow bench dense-shard``."""

from __future__ import annotations

import time

import torch.distributed as dist


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def timed_steps(trainer, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` training steps after ``warmup`` untimed ones, each between
    two barriers (the slowest rank's step)."""
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times
