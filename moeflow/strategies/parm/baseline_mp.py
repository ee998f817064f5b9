"""Parm's baseline (Fig. 3a) with tensor parallelism and whole experts (``N_MP > 1``,
``N_ESP = 1``): DeepSpeed-MoE 0.8.1's duplicate-token drop.

Parm's baseline is DeepSpeed-MoE 0.8.1 (Section V, footnote 1). When its experts are not
tensor parallel and an mpu is set, 0.8.1's ``MOELayer.forward`` (``deepspeed/moe/
sharded_moe.py``) keeps, before the first EP-AlltoAll, this MP rank's ``1 / N_MP`` of every
expert's capacity slots of the ``E C M`` dispatch buffer (``drop_tokens`` on the capacity
dimension: the MP ranks hold the same tokens, so the rest are duplicates) and all-gathers the
experts' outputs over the MP group after the second (``gather_tokens``); its backward gathers
the input gradient's parts (``drop_tokens``' adjoint) and takes this rank's part of the output
gradient (``gather_tokens``'). Per rank and pass: EP-AlltoAll ``E C M / N_MP`` x 2 and
MP-AllGather ``E C M / N_MP``, where sending every MP copy moved ``E C M`` x 2.

Here: every MP rank gates the whole (replicated) batch, as 0.8.1 does, so capacity and drops
are the single-rank layer's; MP rank m keeps rows ``[floor(m c_e / N_MP), floor((m+1) c_e /
N_MP))`` of expert e's ``c_e`` rows of the send buffer (0.8.1's split of the capacity slots
where ``N_MP`` divides ``C``, which 0.8.1 requires; dropless: of the expert's rows), the share
goes through the plain expert-parallel exchange (``schedule.pipeline``: codecs, chunks,
schedulers, shared experts as task S), and the MP-AllGather (:func:`.collectives.
mp_gather_replicated`) puts every share back in buffer order. The MP ranks must route
identically (one plan split over the group, as S2): ``gate_noise > 0`` is refused
(:mod:`.checks`) and ``parm_check_plan=True`` checks the plans.

Beyond 0.8.1 (whose buffer is the padded ``E C M``): with a trimmed plan
(``MoEConfig.capacity_padding``, :mod:`.padding`) ``c_e`` is expert e's kept rows, so the drop
splits only the kept rows over the MP group and the padding crosses no link (used by the
baseline here and by the ``ted`` schedule, :mod:`.ted`).
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.dispatch.plan import DispatchPlan
from moeflow.schedule.chunks import block_rows, chunk_counts, to_device
from moeflow.schedule.pipeline import ScheduledExperts, scheduled_experts
from moeflow.strategies.parm.collectives import mp_gather_replicated, mp_split
from moeflow.strategies.parm.ep_esp import block_counts
from moeflow.topology import Topology


def drops_mp_duplicates(topo: Topology) -> bool:
    """True where the baseline drops the MP duplicates (0.8.1's whole-expert case)."""
    return topo.mp_size > 1 and topo.esp_size == 1


def mp_shares(plan: DispatchPlan, topo: Topology) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(C, rows)``: ``C[q][e]``, the rows slot q of the EP&ESP block (the EP rank q when
    ``N_ESP = 1``) sends to expert e after the drop (its MP rank's share of its whole buffer),
    and ``rows[m]``, the rows of this rank's buffer MP rank m keeps (every MP rank holds the
    same plan, so each knows the others' shares)."""
    full = block_counts(plan, topo)           # (u, E): the block's whole buffers
    mp, u, me = topo.mp_size, topo.expert_slots, topo.expert_slot
    shares = chunk_counts(full, mp)           # shares[m][q]: MP rank m's share of q's buffer
    first = topo.rank - me
    C = np.stack([shares[(first + q) % mp][q] for q in range(u)])
    starts = np.cumsum(full[me]) - full[me]
    rows = [block_rows(starts + (full[me] * m) // mp, shares[m][me]) for m in range(mp)]
    return C, rows


def mp_dropped_experts(send: torch.Tensor, plan: DispatchPlan, runner: ScheduledExperts,
                       topo: Topology, shared_in: torch.Tensor | None = None):
    """Differentiable: this rank's whole send buffer -> the experts' outputs of its rows (same
    order), through the drop, the EP-AlltoAll, the experts, the EP-AlltoAll back and the
    MP-AllGather; with ``shared_in`` (and ``runner.shared``) also the shared experts' output,
    ``(rows, shared_out)``, as :func:`~moeflow.schedule.pipeline.scheduled_experts`."""
    C, rows = mp_shares(plan, topo)
    me, me_mp, dev = topo.expert_slot, topo.mp_rank, send.device
    piece = mp_split(send, [to_device(r, dev) for r in rows], me_mp, topo.mp_group)
    dropped = DispatchPlan(plan.num_experts, plan.num_tokens, plan.top_k, plan.capacity,
                           plan.slot, int(C[me].sum()), plan.dropped, counts=C,
                           ep_rank=topo.ep_rank)
    out = scheduled_experts(piece, dropped, runner, shared_in)
    back, shared = out if shared_in is not None else (out, None)
    gathered = mp_gather_replicated(back, [r.size for r in rows], me_mp, topo.mp_group)
    order = np.argsort(np.concatenate(rows), kind="stable")      # back to buffer order
    y = gathered.index_select(0, to_device(order, dev))
    return (y, shared) if shared_in is not None else y
