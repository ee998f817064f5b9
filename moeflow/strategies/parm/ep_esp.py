"""Parm's EP&ESP-AlltoAll (Section III-C, Fig. 4c-d): local dump, one all-to-all, local combine.

The N_EP x N_ESP ranks of an EP&ESP block (``topo.ep_esp_group``) hold every expert once, as
N_ESP shards each. Instead of the baseline's ESP-AllGather + EP-AlltoAll (Fig. 4a), a rank
*dumps* its send buffer locally (Fig. 4c): for every rank ``q`` of the block, in group order,
the rows for the experts of q's EP position, so each expert's rows appear once per shard. One
all-to-all over the block then brings every shard the rows of its experts from every rank of
the block, intra-node and inter-node transfers in the same collective. The shards compute
partial outputs (:meth:`ExpertFFN.partial`); the all-to-all back returns them and the *local
combine* (Fig. 4d) sums each row's N_ESP partials, replacing the baseline's ESP-AllReduce,
EP-AlltoAll and ESP-Split (Fig. 4b).

The dumped buffer is an ordinary expert-parallel send buffer over the block seen as one EP group
of ``u = N_EP N_ESP`` ranks with ``u E_local`` *virtual* experts (virtual expert ``(q, l)`` is
local expert l of rank q: global expert ``ep(q) E_local + l``, shard ``esp(q)``), so the whole
exchange runs through :func:`moeflow.schedule.pipeline.scheduled_experts`: codecs encode the
EP&ESP payloads, the all-to-all algorithm (``direct`` / ``pairwise``) runs over the block, and
ScheMoE's chunks (``pipeline_degree``) and schedulers apply to it unchanged. Dump and combine
are ``index_select`` / ``index_add``, adjoint to each other, so autograd differentiates them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from moeflow.dispatch.plan import DispatchPlan, count_matrix
from moeflow.schedule.chunks import to_device
from moeflow.schedule.pipeline import ScheduledExperts, scheduled_experts
from moeflow.topology import Topology


def ep_esp_view(topo: Topology) -> Topology:
    """The EP&ESP block as one expert-parallel group of ``u`` ranks (group rank = block slot),
    for the all-to-all algorithms, which run over ``topo.ep_group``."""
    return dataclasses.replace(topo, ep_size=topo.expert_slots, esp_size=1, esp_in_node=True,
                               ep_group=topo.ep_esp_group, mp_size=1, esp_group=None)


class ShardPartials(nn.Module):
    """The local experts as the EP&ESP exchange runs them: partial outputs, no ESP-AllReduce
    (the tokens' ranks sum them in the local combine). Same parameters as ``experts``."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts

    def forward(self, x: torch.Tensor, counts: list[int],
                offsets: torch.Tensor | None = None) -> torch.Tensor:
        return self.experts.partial(x, counts, offsets)


def block_counts(plan: DispatchPlan, topo: Topology) -> np.ndarray:
    """``C[q][e]``: rows rank q of this EP&ESP block sends to expert e with ``plan`` (collective
    over the block: dropless reads the device counts once, capacity sends host integers: each
    rank's ``C_p``, or with a trimmed plan its kept rows per expert, ``plan.host_counts``;
    beyond the paper, :mod:`.padding`).
    Kept on the plan: a checkpoint's recomputation replays the plan (moeflow/plan_record.py)
    and exchanges no counts again."""
    cached = getattr(plan, "block_counts", None)
    if cached is not None:
        return cached
    counts = count_matrix(plan, topo.ep_esp_group, topo.expert_slots, "ep_esp")
    plan.block_counts = counts
    return counts


@dataclasses.dataclass
class Dump:
    """Host bookkeeping of one EP&ESP exchange: the dump index of this rank's buffer and the
    count matrix of the block's dumped buffers (virtual experts, see the module docstring)."""

    index: np.ndarray         # dumped row i = send-buffer row index[i]
    counts: np.ndarray        # (u, u E_local): rows slot p sends to virtual expert (q, l)
    slot: int

    @classmethod
    def build(cls, C: np.ndarray, topo: Topology) -> "Dump":
        """``C``: (u, E) rows every slot's (expert-major) send buffer holds per expert."""
        u, E = C.shape
        e_local = E // topo.ep_size
        ep_of = [topo.slot_coords(q)[0] for q in range(u)]
        experts = np.concatenate([np.arange(j * e_local, (j + 1) * e_local) for j in ep_of])
        counts = C[:, experts]                                   # (u, u E_local)
        me = topo.expert_slot
        ends = np.cumsum(C[me])
        starts = ends - C[me]
        # Fig. 4c: for every slot q in group order, rows of the experts of EP rank ep(q)
        # (consecutive in the expert-major buffer)
        index = np.concatenate(
            [np.arange(starts[j * e_local], ends[(j + 1) * e_local - 1]) for j in ep_of]
            + [np.zeros(0, dtype=np.int64)])
        return cls(index.astype(np.int64), counts, me)

    def plan(self, like: DispatchPlan) -> DispatchPlan:
        """The dumped buffer's plan over the block seen as one EP group."""
        rows = int(self.index.size)
        return DispatchPlan(self.counts.shape[1], like.num_tokens, like.top_k, like.capacity,
                            like.slot, rows, like.dropped, counts=self.counts,
                            ep_rank=self.slot)

    @property
    def matrix(self) -> np.ndarray:
        """``S[p][q]``: rows slot p sends to slot q."""
        u = self.counts.shape[0]
        return self.counts.reshape(u, u, -1).sum(2)


def local_dump(send: torch.Tensor, dump: Dump) -> torch.Tensor:
    """Fig. 4c: the send buffer's rows, once per shard of their expert, in block order."""
    return send.index_select(0, to_device(dump.index, send.device))


def local_combine(back: torch.Tensor, index: np.ndarray, rows: int) -> torch.Tensor:
    """Fig. 4d: ``out[index[i]] += back[i]``, the sum of each row's partial outputs."""
    out = back.new_zeros((rows,) + tuple(back.shape[1:]))
    return out.index_add(0, to_device(index, back.device), back)


def ep_esp_experts(send: torch.Tensor, plan: DispatchPlan, runner: ScheduledExperts,
                   topo: Topology, C: np.ndarray | None = None) -> torch.Tensor:
    """Differentiable: this rank's send buffer -> the experts' outputs of its rows (same
    order), through local dump, EP&ESP-AlltoAll, expert shards, EP&ESP-AlltoAll back and local
    combine. ``runner`` runs :class:`ShardPartials` over :func:`ep_esp_view`'s all-to-all;
    ``C``: the block's count matrix when the caller has it (else gathered here)."""
    dump = Dump.build(block_counts(plan, topo) if C is None else C, topo)
    back = scheduled_experts(local_dump(send, dump), dump.plan(plan), runner)
    return local_combine(back, dump.index, send.shape[0])
