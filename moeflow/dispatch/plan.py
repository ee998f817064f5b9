"""The dispatch plan: for every kept (token, choice) its row in the send buffer, and split sizes.

The send buffer is expert-major: rows for expert 0, then expert 1, ... so that consecutive
blocks go to consecutive ranks of the expert-parallel group (rank p holds experts
``[p*E_l, (p+1)*E_l)``).

* Capacity mode (GShard): each expert has C slots; assignments take slots in priority order
  (all first choices in token order, then all second choices, ...) and those past C are
  dropped. The buffer has ``E*C`` rows, unused slots are zero; splits are static.
* Dropless: every assignment gets a row, sorted stably by expert.

In both modes the per-expert row counts are exchanged first (``E`` integers) so that receivers
know their split sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.comm.alltoall.base import AllToAll
from moeflow.comm.exchange import exchange_counts


@dataclass
class DispatchPlan:
    num_tokens: int
    capacity: int | None
    token: torch.Tensor          # (A,) token of each kept assignment
    choice: torch.Tensor         # (A,) which of the k choices it is
    slot: torch.Tensor           # (A,) its row in the send buffer
    send_rows: int
    send_splits: list[int]       # rows to each rank of the EP group
    recv_splits: list[int]       # rows from each rank of the EP group
    recv_counts: torch.Tensor    # (ep, E_local) rows received per (source rank, local expert)
    send_counts: torch.Tensor    # (E,) rows sent per global expert (expert-major send buffer)
    dropped: int                 # assignments dropped by capacity

    @property
    def dense_slots(self) -> bool:
        """True when every send row is used exactly once, in slot order (dropless)."""
        return self.capacity is None


def make_plan(experts: torch.Tensor, num_experts: int, capacity: int | None,
              algo: AllToAll) -> DispatchPlan:
    """Build the plan for ``experts: (T, k)``; collective (exchanges the row counts)."""
    T, k = experts.shape
    ep = algo.topo.ep_size
    e_local = num_experts // ep
    flat = experts.t().reshape(-1)                       # priority order: choice-major
    counts = torch.bincount(flat, minlength=num_experts)
    order = torch.argsort(flat, stable=True)             # expert-major, priority kept inside
    if capacity is None:
        kept, slot = order, torch.arange(flat.numel(), device=flat.device)
        per_expert = counts
        send_rows, dropped = flat.numel(), 0
    else:
        starts = torch.cumsum(counts, 0) - counts          # slot of each choice in its expert
        position = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        keep = position < capacity
        kept = order[keep]
        slot = flat[kept] * capacity + position[keep]
        per_expert = torch.full((num_experts,), capacity, dtype=torch.long,
                                device=flat.device)
        send_rows, dropped = num_experts * capacity, int(flat.numel() - kept.numel())
    # Counts travel first: every receiver learns its row counts per (source, local expert).
    # In capacity mode they are the senders' capacities, which differ between ranks with
    # different token counts (capacity is per local batch).
    recv_counts = exchange_counts(per_expert, algo).view(ep, e_local)
    return DispatchPlan(num_tokens=T, capacity=capacity, token=kept % T,
                        choice=torch.div(kept, T, rounding_mode="floor"), slot=slot,
                        send_rows=send_rows,
                        send_splits=per_expert.view(ep, e_local).sum(1).tolist(),
                        recv_splits=recv_counts.sum(1).tolist(),
                        recv_counts=recv_counts.cpu(), send_counts=per_expert.cpu(),
                        dropped=dropped)
