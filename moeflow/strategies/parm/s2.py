"""Parm's schedule S2 (Section III-B, Fig. 3c, Eq. 7 / 14): PauseMP after the gate.

gate -> MP-Split -> local dump -> EP&ESP-AlltoAll -> expert shards -> EP&ESP-AlltoAll with
the MP-AllGather simultaneously (SAA, :mod:`.saa`) -> local combine -> (gate-weighted combine).

Every MP rank gates the whole (replicated) batch, as the baseline does, so capacity and drops
are the baseline's. MP-Split then keeps MP rank m's share of every expert's rows of the send
buffer (``[floor(m c_e / N_MP), floor((m+1) c_e / N_MP))`` of expert e's ``c_e`` rows; all MP
ranks hold the same plan, so each knows the others' shares). Its share is dumped and exchanged
(all-to-all volume ``E T M N_ESP / N_MP``, Eq. 7); the partial outputs that come back are
all-gathered over the MP group together with the all-to-all (SAA, Fig. 5: the AllGather carries
the received slices, the shards' partials) and the local combine sums the partials of every MP
rank's rows into the whole send buffer, which every MP rank then combines with its own gates.

``saa=False`` runs AAS instead: the exchange goes through
:func:`moeflow.schedule.pipeline.scheduled_experts` (codecs, chunks and schedulers apply to the
EP&ESP payloads) and the MP-AllGather follows it. SAA runs its own phased exchange with the
experts between the two all-to-alls, so it takes neither codecs nor chunks (refused by
``check_parm_layer``).

S2 keeps the capacity layout under ``MoEConfig.capacity_padding="trim"`` (:mod:`.padding`:
its SAA phases are not extended to trimmed plans; ``layer.stats["parm_trimmed"]`` is 0).
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.dispatch.plan import DispatchPlan
from moeflow.strategies.parm.collectives import all_to_all, mp_all_gather, mp_split
from moeflow.strategies.parm.ep_esp import Dump, block_counts, local_combine, local_dump
from moeflow.strategies.parm.saa import saa as run_saa
from moeflow.schedule.chunks import Grouping, block_rows, chunk_counts, to_device
from moeflow.schedule.pipeline import ScheduledExperts, scheduled_experts
from moeflow.topology import Topology


def mp_slots(topo: Topology) -> list[int]:
    """The EP&ESP block slot of every rank of this rank's MP group, in MP order."""
    first = topo.rank - topo.mp_rank
    return [(first + m) % topo.expert_slots for m in range(topo.mp_size)]


def s2_experts(send: torch.Tensor, plan: DispatchPlan, runner: ScheduledExperts,
               topo: Topology, saa: bool = True) -> torch.Tensor:
    """Differentiable: the whole send buffer (every MP rank's, the same) -> the experts'
    outputs of its rows, through MP-Split, dump, EP&ESP-AlltoAll, shards, SAA (or AAS) and
    local combine."""
    u, mp, me_mp = topo.expert_slots, topo.mp_size, topo.mp_rank
    full = block_counts(plan, topo)                 # (u, E): every slot's whole send buffer
    first = topo.rank - topo.expert_slot
    shares = chunk_counts(full, mp)                 # shares[m][q]: MP rank m's share of q's
    C = np.stack([shares[(first + q) % mp][q] for q in range(u)])
    me = topo.expert_slot
    starts = np.cumsum(full[me]) - full[me]
    # rows of the whole buffer each MP rank of this group keeps (the group holds one plan)
    rows = [block_rows(starts + (full[me] * m) // mp, shares[m][me]) for m in range(mp)]
    piece = send
    if mp > 1:                                      # MP-Split after the gate (Fig. 3c)
        piece = mp_split(send, [to_device(r, send.device) for r in rows], me_mp,
                         topo.mp_group)
    dump = Dump.build(C, topo)
    dumped = local_dump(piece, dump)
    # every MP rank's dump of its share (their slots differ, the experts' order is the same)
    peer_dumps = [Dump.build(np.where(np.arange(u)[:, None] == me, shares[m][me], C), topo)
                  for m in range(mp)]
    if saa:
        gathered = _saa_experts(dumped, dump, peer_dumps, runner, topo)
    else:                                           # AAS: the pipeline, then the AllGather
        back = scheduled_experts(dumped, dump.plan(plan), runner)
        gathered = back if mp == 1 else mp_all_gather(
            back, [d.index.size for d in peer_dumps], me_mp, topo.mp_group)
    index = np.concatenate([rows[m][peer_dumps[m].index] for m in range(mp)])
    return local_combine(gathered, index, send.shape[0])          # Fig. 4d


def _saa_experts(dumped: torch.Tensor, dump: Dump, peer_dumps: list[Dump],
                 runner: ScheduledExperts, topo: Topology) -> torch.Tensor:
    """EP&ESP-AlltoAll, expert shards, then SAA (all-to-all back with the MP-AllGather)."""
    S, me, u = dump.matrix, dump.slot, topo.expert_slots
    got = all_to_all(dumped, S[me].tolist(), S[:, me].tolist(), topo.ep_esp_group)
    e_local = dump.counts.shape[1] // u
    g = Grouping.build(dump.counts[:, me * e_local:(me + 1) * e_local], dumped.device)
    y = g.ungroup(runner.experts(g.group(got), g.counts, g.offsets))
    # rows MP rank m receives back from slot p: its share's rows for p's experts
    ag = np.stack([d.matrix[me] for d in peer_dumps])
    first = topo.rank - topo.expert_slot
    return run_saa(y, S[:, me].tolist(), S[me].tolist(), ag, me, mp_slots(topo), topo.mp_rank,
                   [first + p for p in range(u)], topo.ep_esp_group, topo.mp_group)
