"""The dispatch plan: for every routing choice its row in the send buffer, and the count matrix.

The send buffer is expert-major: rows for expert 0, then expert 1, ... so that consecutive
blocks go to consecutive ranks of the expert-parallel group (rank p holds experts
``[p*E_l, (p+1)*E_l)``). Choices are numbered choice-major, ``a = j*T + t`` (all first choices
in token order, then all second choices, ...), which is GShard's priority order.

* Capacity mode (GShard section 2.2): each expert has C slots; choices take slots in priority
  order and those past C are dropped. The buffer has ``E*C`` rows, unused slots are zero.
  Every choice keeps an entry: a dropped one points at row ``E*C``, a scratch row that
  :func:`~moeflow.dispatch.permute.permute` cuts off, and carries no gate. So the plan is
  built with no data-dependent shapes and no host synchronisation.
* Capacity with trimmed padding (``trim=True``, ``MoEConfig.capacity_padding``): the same kept
  choices and the same function, but each expert's block holds only its ``min(n_e, C)`` kept
  rows, so the exchange and the experts skip the empty slots (with balanced routing at f = 1.25
  they are a fifth of the ``E*C`` rows; Tutel sends and computes them). The kept counts come to
  the host once (one synchronisation on a GPU, none on CPU) and travel as host integers.
* Dropless: every choice gets a row, sorted stably by expert; the only host synchronisation
  of the layer is learning the counts (:func:`moeflow.comm.exchange.gather_device_counts`).

Building the plan touches only the device (``torch.compile`` traces it); :func:`exchange_counts`
then gives every rank the count matrix ``N[p][e]`` on the host, from which the split sizes of
every exchange of the call follow (:mod:`moeflow.schedule.chunks`). In untrimmed capacity mode
that is a gather of every rank's ``C_p`` on each call, or, with ``MoEConfig.equal_rank_tokens``,
on the first call of each distinct (tokens, top_k, capacity factor) only
(:func:`capacity_counts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeflow.comm.exchange import gather_device_counts, gather_host_ints, to_host
from moeflow.errors import ConfigError
from moeflow.topology import Topology


@dataclass
class KnownCapacities:
    """``MoEConfig.equal_rank_tokens``: every rank's ``C_p`` remembered per call key, so that
    capacity mode gathers them once per distinct key instead of on every call.

    Skipping a collective is safe only when every rank of the group skips it too: the key is
    ``(layer input tokens, top_k, capacity factor)``, equal on every rank by the config's
    promise, so every rank makes the same hit-or-miss decision. The first call of a key checks
    the promise in the same gather (each rank's token count beside its ``C_p``)."""

    table: dict          # the layer's: (group name, key) -> (size,) capacities, row p = rank p
    key: tuple           # this call's (input tokens, top_k, capacity factor)
    tokens: int          # this rank's layer input tokens


@dataclass
class DispatchPlan:
    num_experts: int
    num_tokens: int
    top_k: int
    capacity: int | None
    slot: torch.Tensor           # capacity: (T*k,) row of choice a, E*C when dropped;
                                 # dropless: (T*k,) choice held by row i (expert-major order)
    send_rows: int
    dropped: torch.Tensor        # 0-dim: choices dropped by capacity (on the device)
    local_counts: torch.Tensor | None = None   # dropless: (E,) rows per expert, on the device
    counts: np.ndarray | None = None  # (ep, E) rows EP rank p sends to expert e (host; set by
    ep_rank: int = 0                  # exchange_counts)
    host_counts: np.ndarray | None = None  # trimmed capacity: (E,) kept rows per expert, host
    known: KnownCapacities | None = None   # MoEConfig.equal_rank_tokens: see capacity_counts

    @property
    def dense_slots(self) -> bool:
        """True when every send row holds exactly one choice (dropless)."""
        return self.capacity is None

    @property
    def num_local(self) -> int:
        return self.counts.shape[1] // self.counts.shape[0]


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Choices per expert. ``index_add`` rather than ``bincount``, which on CUDA reads the
    maximum back to the host to size its output."""
    return flat.new_zeros(num_experts).index_add_(0, flat, torch.ones_like(flat))


def padding_trimmed(mode: str, device: torch.device) -> bool:
    """Whether ``MoEConfig.capacity_padding=mode`` trims on ``device`` where the strategy's
    schedule can send only the kept rows: "trim" always, "pad" never, "auto" where the host
    read of the kept counts is free: on CPU, in eager mode (under ``torch.compile`` it would
    break the graph at the plan, so "auto" pads there). The same answer on every rank of a
    job (its config's mode, its device type)."""
    if mode == "pad":
        return False
    return mode == "trim" or (device.type == "cpu" and not torch.compiler.is_compiling())


def make_plan(experts: torch.Tensor, num_experts: int, capacity: int | None,
              trim: bool = False) -> DispatchPlan:
    """Build the plan for ``experts: (T, k)`` (device work only, no communication; with
    ``trim``, capacity mode's kept counts come to the host: see the module docstring)."""
    T, k = experts.shape
    flat = experts.t().reshape(-1)                       # priority order: choice-major
    order = torch.argsort(flat, stable=True)             # expert-major, priority kept inside
    counts = expert_counts(flat, num_experts)
    if capacity is None:
        return DispatchPlan(num_experts, T, k, None, order, flat.numel(), flat.new_zeros(()),
                            local_counts=counts)
    # Slot of choice a inside its expert = how many earlier choices picked the same expert:
    # its rank in the stable sort by expert minus the expert's first rank (GShard's cumsum).
    starts = torch.cumsum(counts, 0) - counts
    ranked = torch.arange(flat.numel(), device=flat.device) - starts.index_select(
        0, flat.index_select(0, order))
    position = torch.empty_like(ranked).index_copy_(0, order, ranked)
    keep = position < capacity
    if trim:                   # expert e's block: its min(n_e, C) kept rows, nothing else
        kept = counts.clamp(max=capacity)
        host = to_host(kept)                             # the one host synchronisation
        send_rows = int(host.sum())
        base = (torch.cumsum(kept, 0) - kept).index_select(0, flat)
        slot = torch.where(keep, base + position, send_rows)
        return DispatchPlan(num_experts, T, k, capacity, slot, send_rows, (~keep).sum(),
                            host_counts=host)
    send_rows = num_experts * capacity
    slot = torch.where(keep, flat * capacity + position, send_rows)
    return DispatchPlan(num_experts, T, k, capacity, slot, send_rows, (~keep).sum())


def count_matrix(plan: DispatchPlan, group, size: int, name: str) -> np.ndarray:
    """``(size, E)``: the rows each rank of ``group`` sends to each expert with its plan
    (collective over ``group``; ``name`` tells the layer's groups apart): dropless gathers the
    device counts (the one host synchronisation), trimmed capacity the kept rows per expert
    (host integers), padded capacity each rank's ``C_p``, since rank p sends ``C_p`` rows to
    every expert (:func:`capacity_counts`)."""
    if plan.capacity is None:
        return gather_device_counts(plan.local_counts, group, size)
    if plan.host_counts is not None:           # trimmed capacity: the kept rows per expert
        return gather_host_ints(plan.host_counts.tolist(), group, size)
    return capacity_counts(plan, group, size, name)


def exchange_counts(plan: DispatchPlan, topo: Topology) -> None:
    """Give every rank the count matrix over the EP group (:func:`count_matrix`)."""
    plan.counts = count_matrix(plan, topo.ep_group, topo.ep_size, "ep")
    plan.ep_rank = topo.ep_rank


def gather_known(plan: DispatchPlan, values: list[int], group, size: int, name: str,
                 what: str) -> np.ndarray:
    """Every rank's host integers ``values`` over ``group``, ``(size, len(values))``: one
    gather per call; with ``plan.known`` (``MoEConfig.equal_rank_tokens``) one per distinct
    call key, remembered under ``(name, key)``, whose first gather also checks that every
    rank's token count is equal (a :class:`ConfigError` on every rank alike if not: they all
    see the same gathered values). ``what``: what the ranks skip gathering, for the error."""
    known = plan.known
    if known is None:
        return gather_host_ints(values, group, size)
    got = known.table.get((name, known.key))
    if got is None:
        both = gather_host_ints([known.tokens, *values], group, size)
        if (both[:, 0] != both[0, 0]).any():
            raise ConfigError(
                f"MoEConfig.equal_rank_tokens=True is invalid: the ranks called the layer "
                f"with different token counts ({both[:, 0].tolist()} over the {name} "
                f"group), so they cannot skip the gather of {what}; set "
                "equal_rank_tokens=False, or give every rank batches of the same shape")
        got = known.table[(name, known.key)] = both[:, 1:]
    return got


def capacity_counts(plan: DispatchPlan, group, size: int, name: str) -> np.ndarray:
    """Untrimmed capacity mode's ``(size, E)`` count matrix over ``group`` (``name`` tells the
    layer's groups apart): rank p sends ``C_p`` rows to every expert. One gather of the
    ranks' ``C_p`` per call, or per distinct call key under ``equal_rank_tokens``
    (:func:`gather_known`)."""
    caps = gather_known(plan, [plan.capacity], group, size, name, "their capacities")[:, 0]
    return np.repeat(caps.reshape(-1, 1), plan.num_experts, axis=1)
