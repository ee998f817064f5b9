"""Algorithm 1's memory capacity ``m`` from measured free memory under a user budget (HECATE
Section 4.2: "``m``: the memory capacity, the number of experts a device can additionally
materialize"; Section 3.2: materialized experts are transient copies, their optimizer state
stays with the owner).

What one materialized (non-owned) expert costs on a rank, per FSSDP layer: its row of the
stacked held-expert tensor and that row's gradient (``_Gather``'s backward), both in the slot
tensor's dtype -- :func:`slot_bytes` = ``2 x numel x itemsize``. It carries no optimizer state
and no persistent gradient (spRS returns the gradient to the owner).

Free memory (:func:`free_bytes`): on CUDA ``torch.cuda.mem_get_info``'s free bytes plus what
PyTorch's caching allocator has reserved but not allocated; on CPU, Linux's ``MemAvailable``
from ``/proc/meminfo``; elsewhere it cannot be measured (``None``), and a fraction budget is
refused while a byte budget is used as given.
"""

from __future__ import annotations

import torch

MEMINFO = "/proc/meminfo"


def free_bytes(device: torch.device) -> int | None:
    """Bytes this rank could still allocate on ``device`` (None: not measurable here)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(0, cached))
    if device.type == "cpu":
        try:
            with open(MEMINFO) as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024         # the file's unit is kB
        except OSError:
            return None
    return None


def slot_bytes(numel: int, itemsize: int) -> int:
    """Bytes one extra materialized expert takes: its held row and that row's gradient."""
    return 2 * numel * itemsize


def capacity_from_budget(budget_bytes: int | None, fraction: float | None,
                         free: int | None, per_slot: int) -> int:
    """This rank's ``m``: the extra experts that fit in ``min(budget_bytes, free)`` (byte
    budget; ``free`` None: the budget alone) or in ``fraction x free`` (fraction budget)."""
    if per_slot <= 0:
        raise ValueError(f"capacity_from_budget: per-expert bytes {per_slot} must be > 0")
    if fraction is not None:
        if free is None:
            raise RuntimeError("MoEConfig.fssdp.memory_budget_fraction: free memory cannot be "
                               "measured on this device; give memory_budget_bytes instead")
        budget = int(fraction * free)
    else:
        budget = budget_bytes if free is None else min(budget_bytes, free)
    return max(0, budget // per_slot)


__all__ = ["capacity_from_budget", "free_bytes", "slot_bytes"]
