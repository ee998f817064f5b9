"""Parm's schedule S1 (Section III-B, Fig. 3b, Eq. 11): PauseMP before the gate.

MP-Split -> gate -> local dump -> EP&ESP-AlltoAll -> expert shards -> EP&ESP-AlltoAll ->
local combine -> (gate-weighted combine) -> MP-AllGather.

The MoE input is replicated over the MP group; MP rank m keeps tokens ``[m n / N_MP,
(m+1) n / N_MP)`` (MP-Split, no communication forward, an AllGather backward), gates and
dispatches only those, and the MP-AllGather after the layer restores the replicated output.
Every token is gated and computed once per MP group (no duplicated work, Eq. 11: the
all-to-all carries ``E T M N_ESP / N_MP`` elements and the AllGather ``B L M``).

Routing semantics differ from the baseline and S2: the gate sees ``1/N_MP`` of the batch, so
capacity ``C = ceil(f k (n / N_MP) / E)`` and which choices it drops are those of the MP part
as a batch of its own, and the load-balancing loss is computed per part; the layer's
``aux_loss`` is the mean of the MP parts' losses (gathered, so replicated over the MP group as
the output is, and differentiable). A single-process reference that runs each MP part as its
own batch computes the same function (``tests/helpers/parm_sched_cases.py``).
"""

from __future__ import annotations

import torch

from moeflow.strategies.parm.collectives import mp_all_gather, mp_split
from moeflow.topology import Topology


def token_rows(n: int, mp: int) -> list[range]:
    """The tokens MP rank m keeps of ``n``: ``[floor(m n / mp), floor((m+1) n / mp))``."""
    return [range((n * m) // mp, (n * (m + 1)) // mp) for m in range(mp)]


def mp_split_tokens(h: torch.Tensor, topo: Topology) -> torch.Tensor:
    """MP-Split before the gate (Fig. 3b): this MP rank's tokens of ``h: (n, M)``."""
    if topo.mp_size == 1:
        return h
    rows = [torch.arange(r.start, r.stop, device=h.device)
            for r in token_rows(h.shape[0], topo.mp_size)]
    return mp_split(h, rows, topo.mp_rank, topo.mp_group)


def mp_gather_tokens(y: torch.Tensor, n: int, topo: Topology) -> torch.Tensor:
    """MP-AllGather after the layer (Fig. 3b): every MP rank's outputs, ``(n, M)``."""
    if topo.mp_size == 1:
        return y
    sizes = [len(r) for r in token_rows(n, topo.mp_size)]
    return mp_all_gather(y, sizes, topo.mp_rank, topo.mp_group)


def mp_mean_loss(loss: torch.Tensor, topo: Topology) -> torch.Tensor:
    """The mean over the MP group of the parts' auxiliary losses (differentiable)."""
    if topo.mp_size == 1:
        return loss
    parts = mp_all_gather(loss.reshape(1), [1] * topo.mp_size, topo.mp_rank, topo.mp_group)
    return parts.mean()
