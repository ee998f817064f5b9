"""Algorithm 1's memory capacity ``m`` (HECATE Section 4.2: "the maximum number of experts that
can be materialized on each device's available memory", profiled by the scheduler and passed to
the algorithm) from the device's free memory at start and the bytes each replica really costs.

**What one FSSDP layer allocates in an iteration** (:mod:`moeflow.strategies.fssdp.layer_experts`,
:mod:`moeflow.comm.sparse`), in *rows* of one expert (``numel x itemsize`` bytes), on a rank that
holds ``H = S + R`` experts (``S`` owned by it in this layer, ``R`` replicas received) of a slot
tensor of ``S_slot`` rows (every FSSDP layer's owned experts in the GPT, which shares it):

1. forward, spAG and stacking (Section 3.2, materialization phase): the ``R`` receive copies and
   the stacked held tensor ``H`` alive at once -- ``R + H``;
2. backward of the experts: the held tensor ``H`` (kept for the backward without
   re-materialization, refilled by the second spAG with it) and its gradient, which autograd
   builds from the experts' per-weight views (``w1``, ``w2``, ...): one full ``(H, numel)``
   gradient per view, summed pairwise, so three of them alive at the sum
   (:data:`HELD_GRAD_COPIES`) -- ``H + 3 H``;
3. spRS (Section 3.1) with the ``p2p`` transport: the held tensor and its gradient, plus on an
   owner one receive buffer per other holder of each owned expert (``G``: up to ``|D| - 1`` per
   hot owned expert, all allocated at once) and one sum per owned expert held elsewhere
   (``A``) -- ``2 H + G + A``; with the ``broadcast`` transport each replicated held expert's
   gradient is copied once for the reduce (``B``) instead -- ``2 H + B``;
4. the zeroed whole-slot gradient the stacking's backward returns (``S_slot`` rows), beside the
   held tensor, its gradient and the owner's sums -- ``2 H + A + S_slot``.

The layer's peak is the largest of the four (:func:`layer_peak_rows`); rows are costed in the
slot tensor's dtype (an upper bound where HECATE-RM under autocast holds the stacked tensor in a
narrower one). A replica carries no
optimizer state (Section 3.2: the state stays with the owner; the optimizer sees only
``slots``), so none is counted.

**m** (:func:`capacity_from_budget`): the largest count such that the worst case of any
placement with at most ``m`` replicas per device adds at most the budget to the peak of
``P' = P`` (the floor FSSDP always runs): ``H = S + m``, ``R = m``, ``G <= min(S (|D| - 1),
(|D| - 1) m)`` and ``A <= min(S, (|D| - 1) m)`` (every device holds at most ``m`` replicas: the
ranks agree on the smallest ``m``, the one integer of Algorithm 1). With many replicas the
held tensor's backward dominates: four rows per replica (its row and three gradient copies).

**Free memory at start** (:func:`free_at_start`): the device's free memory measured once per
process and device, at the first count exchange of any FSSDP layer -- before any layer has
stacked held experts -- and reused by every layer after. Measured per layer instead, a fraction
budget would shrink with depth without re-materialization: each later layer would see the
memory the earlier layers' held experts (kept for the backward) and activations already took.
On CUDA ``torch.cuda.mem_get_info``'s free bytes plus what PyTorch's caching allocator has
reserved but not allocated; on CPU, Linux's ``MemAvailable`` from ``/proc/meminfo``; elsewhere it
cannot be measured (``None``): a fraction budget is refused there, a byte budget is used as given.
"""

from __future__ import annotations

import torch

from moeflow.strategies.fssdp.placement import Placement

MEMINFO = "/proc/meminfo"
# full-size gradients of the held tensor alive at once in the experts' backward: autograd's
# slice backward gives one (H, numel) gradient per weight view, summed pairwise
HELD_GRAD_COPIES = 3
TRANSPORT_ROWS = ("p2p", "broadcast")

_START: dict[str, int | None] = {}      # device -> free bytes at the first measurement


def free_bytes(device: torch.device) -> int | None:
    """Bytes this rank could still allocate on ``device`` now (None: not measurable here)."""
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


def free_at_start(device: torch.device, measure=None) -> int | None:
    """The device's free memory at start: measured (``measure``, default :func:`free_bytes`)
    on the first call for ``device`` in this process, the same value on every later call."""
    key = str(device)
    if key not in _START:
        _START[key] = (measure or free_bytes)(device)
    return _START[key]


def forget_start() -> None:
    """Drop the start measurements (a new job in the same process, tests)."""
    _START.clear()


def layer_peak_rows(placement: Placement, rank: int, slot_rows: int,
                    transport: str = "p2p") -> int:
    """The most expert rows this layer's materialization allocates at once on ``rank`` in one
    iteration over ``placement`` (the four phases of the module docstring; the slot tensor
    itself and its persistent gradient excluded)."""
    if transport not in TRANSPORT_ROWS:
        raise ValueError(f"layer_peak_rows: transport={transport!r}: give one of "
                         f"{', '.join(TRANSPORT_ROWS)}")
    held = placement.held(rank)
    H, R = len(held), len(placement.replicas(rank))
    owned = placement.owned(rank)
    A = sum(1 for e in owned if len(placement.holders[e]) > 1)
    if transport == "p2p":
        sprs = sum(len(placement.holders[e]) - 1 for e in owned) + A
    else:
        sprs = sum(1 for e in held if len(placement.holders[e]) > 1)
    return max(R + H, (1 + HELD_GRAD_COPIES) * H, 2 * H + sprs, 2 * H + A + slot_rows)


def worst_peak_rows(m: int, owned: int, world: int, slot_rows: int,
                    transport: str = "p2p") -> int:
    """:func:`layer_peak_rows`' bound over every placement with at most ``m`` replicas per
    device, on a rank owning ``owned`` experts of the layer (``transport="auto"``: the larger
    of the two transports' bounds, since either may be chosen)."""
    if transport == "auto":
        return max(worst_peak_rows(m, owned, world, slot_rows, t) for t in TRANSPORT_ROWS)
    H, others = owned + m, (world - 1) * m
    A = min(owned, others)
    sprs = (min(owned * (world - 1), others) + A) if transport == "p2p" else m + A
    return max(m + H, (1 + HELD_GRAD_COPIES) * H, 2 * H + sprs, 2 * H + A + slot_rows)


def capacity_from_budget(budget_bytes: int | None, fraction: float | None, free: int | None,
                         row_bytes: int, *, owned: int, world: int, slot_rows: int,
                         num_experts: int, transport: str = "p2p") -> int:
    """This rank's ``m``: the most replicas whose worst-case peak (:func:`worst_peak_rows`)
    exceeds that of ``P' = P`` by at most ``min(budget_bytes, free)`` (byte budget; ``free``
    None: the budget alone) or ``fraction x free`` (fraction budget); at most the experts it
    does not own."""
    if row_bytes <= 0:
        raise ValueError(f"capacity_from_budget: bytes per expert row {row_bytes} must be > 0")
    if fraction is not None:
        if free is None:
            raise RuntimeError("MoEConfig.fssdp.memory_budget_fraction: free memory cannot be "
                               "measured on this device; give memory_budget_bytes instead")
        budget = int(fraction * free)
    else:
        budget = budget_bytes if free is None else min(budget_bytes, free)
    floor = worst_peak_rows(0, owned, world, slot_rows, transport)
    m = 0
    while m < num_experts - owned and \
            (worst_peak_rows(m + 1, owned, world, slot_rows, transport) - floor) * row_bytes \
            <= budget:
        m += 1
    return m


__all__ = ["HELD_GRAD_COPIES", "capacity_from_budget", "forget_start", "free_at_start",
           "free_bytes", "layer_peak_rows", "worst_peak_rows"]
