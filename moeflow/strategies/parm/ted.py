"""DeepSpeed-TED's order as a Parm schedule, with an EP&ESP exchange that crosses to a node once
(``parallel_schedule="ted"``). Beyond the Parm paper: the order is DeepSpeed-TED's (Singh et al.,
ICS 2023, "duplicate token dropping"; DeepSpeed 0.19.8's ``MOELayer.forward``), which Parm's
Section VI ([38]) describes as limited to ESP = MP; the exchange replaces Parm's EP&ESP-AlltoAll
(Section III-C, Fig. 4c), which sends a row to each of its expert's ``N_ESP`` shards.

gate -> drop the MP duplicates -> EP-AlltoAll -> ESP-AllGather -> expert shards ->
ESP-ReduceScatter -> EP-AlltoAll back -> MP-AllGather -> (gate-weighted combine).

* Every MP rank gates the whole (replicated) batch, as the baseline and S2 do, so capacity and
  drops are the single-process layer's; MP rank m keeps its share of every expert's rows of the
  send buffer (0.8.1's ``drop_tokens``, :func:`.baseline_mp.mp_shares`). After the drop every
  rank of the EP&ESP block holds rows no other rank holds.
* The EP-AlltoAll sends a row once, to the rank holding its expert's shard at this rank's ESP
  index (the EP group: same ESP index). With the ESP groups inside a node
  (``esp_in_node=True``) that is the only transfer that can cross nodes, once per row, where the
  EP&ESP-AlltoAll sends it to all ``N_ESP`` shards (``N_ESP`` crossings when they sit on another
  node).
* Inside the receiving ESP group an ESP-AllGather hands every shard the rows of its experts from
  the whole block (TED's all-gather over the tensor-parallel group), the shards compute partial
  outputs (:meth:`ExpertFFN.partial`), and an ESP-ReduceScatter sums them and hands each rank
  the rows it received (TED all-reduces and drops again; the reduce-scatter moves half as much).
* The EP-AlltoAll back returns each row to its sender, and the MP-AllGather
  (:func:`.collectives.mp_gather_replicated`, 0.8.1's ``gather_tokens``) puts every MP rank's
  share back, replicated over the MP group.

Per rank and pass, with ``y = k f B L M`` the send buffer (capacity: ``E C M``): EP-AlltoAll
``y / N_MP`` x 2, ESP-AllGather ``y N_ESP / N_MP`` gathered, ESP-ReduceScatter ``y N_ESP /
N_MP`` reduced, MP-AllGather ``y`` gathered. With ``MoEConfig.capacity_padding`` trimming
(beyond the Parm paper and DeepSpeed-TED, which send the ``E C M`` capacity buffer: Parm
Section III's volumes, DeepSpeed 0.19.8's ``drop_tokens`` on the capacity dimension), the plan
holds each expert's kept rows only (:mod:`.padding`): :func:`.ep_esp.block_counts` gathers
them over the block, the MP drop splits each expert's kept rows, and every collective above
moves the kept rows (``y = M`` x the kept rows), the experts compute no empty slot; the same
drops and outputs. The MP ranks must route identically (one plan split
over them, as S2): ``gate_noise > 0`` with ``mp_size > 1`` is refused, ``parm_check_plan=True``
checks the plans. The exchange runs its own collectives on the calling thread (no codecs:
refused by :mod:`.checks`); with ``pipeline_degree`` > 1 it runs in chunks, pipelined with
``schedule="pipelined"`` (:mod:`.ted_pipelined`, beyond the paper).
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.dispatch.plan import DispatchPlan
from moeflow.schedule.chunks import Grouping, to_device
from moeflow.strategies.parm.baseline_mp import mp_shares
from moeflow.strategies.parm.collectives import (all_to_all, esp_all_gather, esp_reduce_scatter,
                                                 mp_gather_replicated, mp_split)
from moeflow.strategies.parm.ted_pipelined import pipelined_node_once_experts
from moeflow.topology import Topology


def slot_of(topo: Topology):
    """``slot(j, t)``: the EP&ESP block slot of EP rank j, ESP rank t (the mesh's layout)."""
    ep, esp = topo.ep_size, topo.esp_size
    return (lambda j, t: j * esp + t) if topo.esp_in_node else (lambda j, t: t * ep + j)


def node_once_experts(piece: torch.Tensor, C: np.ndarray, experts, topo: Topology
                      ) -> torch.Tensor:
    """Differentiable: this rank's rows (expert-major, ``C[me][e]`` for expert e) -> their
    outputs, through EP-AlltoAll, ESP-AllGather, the shards (``experts(x, counts, offsets)``,
    partial outputs), ESP-ReduceScatter and the EP-AlltoAll back. ``C``: (u, E), the rows every
    slot of the block sends to each expert (each slot's rows its own)."""
    ep, esp, i, s = topo.ep_size, topo.esp_size, topo.ep_rank, topo.esp_rank
    el = C.shape[1] // ep
    slot, me = slot_of(topo), topo.expert_slot
    mine = slice(i * el, (i + 1) * el)
    send = [int(C[me, j * el:(j + 1) * el].sum()) for j in range(ep)]
    recv = [int(C[slot(j, s), mine].sum()) for j in range(ep)]
    got = all_to_all(piece, send, recv, topo.ep_group) if ep > 1 else piece
    sizes = [int(sum(C[slot(j, t), mine].sum() for j in range(ep))) for t in range(esp)]
    rows = esp_all_gather(got, sizes, s, topo.esp_group) if esp > 1 else got
    # the gathered rows: ESP rank t's received rows, from its EP peers in EP order, each
    # expert-major over this EP rank's experts: sources x local experts
    K = np.stack([C[slot(j, t), mine] for t in range(esp) for j in range(ep)])
    g = Grouping.build(K, piece.device)
    y = g.ungroup(experts(g.group(rows), g.counts, g.offsets))
    back = esp_reduce_scatter(y, sizes, s, topo.esp_group) if esp > 1 else y
    return all_to_all(back, recv, send, topo.ep_group) if ep > 1 else back


def ted_experts(send: torch.Tensor, plan: DispatchPlan, experts, topo: Topology,
                stats: dict | None = None, chunks: int = 1, overlap: bool = True
                ) -> torch.Tensor:
    """Differentiable: the whole send buffer (the same on every MP rank) -> the experts'
    outputs of its rows (same order), in DeepSpeed-TED's order (module docstring). ``stats``:
    gets ``parm_inter_node_bytes``, the forward's bytes to other nodes (:func:`inter_node_rows`;
    the backward moves the same). ``chunks`` > 1: the exchange in that many chunks, pipelined
    when ``overlap`` (:mod:`.ted_pipelined`; the same bytes)."""
    C, rows = mp_shares(plan, topo)
    mp, me_mp, dev = topo.mp_size, topo.mp_rank, send.device
    if stats is not None:
        stats["parm_inter_node_bytes"] = float(
            inter_node_rows(C, [r.size for r in rows], topo) * send.shape[1]
            * send.element_size())
    if mp == 1:
        return _exchange(send, C, experts, topo, chunks, overlap)
    piece = mp_split(send, [to_device(r, dev) for r in rows], me_mp, topo.mp_group)
    back = _exchange(piece, C, experts, topo, chunks, overlap)
    gathered = mp_gather_replicated(back, [r.size for r in rows], me_mp, topo.mp_group)
    order = np.argsort(np.concatenate(rows), kind="stable")      # back to buffer order
    return gathered.index_select(0, to_device(order, dev))


def _exchange(piece: torch.Tensor, C: np.ndarray, experts, topo: Topology, chunks: int,
              overlap: bool) -> torch.Tensor:
    if chunks == 1:
        return node_once_experts(piece, C, experts, topo)
    return pipelined_node_once_experts(piece, C, experts, topo, chunks, overlap, slot_of(topo))


def inter_node_rows(C: np.ndarray, mp_rows: list[int], topo: Topology) -> int:
    """Rows this rank's forward addresses to ranks on other nodes (for the layer's stats,
    ``parm_inter_node_bytes``): the EP-AlltoAll out and back (each row once to its expert's EP
    rank), its block of the ESP-AllGather to each remote ESP peer, each remote peer's block of
    the ESP-ReduceScatter, and its block of the MP-AllGather to each remote MP peer
    (``mp_rows[m]``: MP rank m's share). What the collective algorithms add on top (a ring's
    forwarding) is not counted."""
    ep, esp, i, s = topo.ep_size, topo.esp_size, topo.ep_rank, topo.esp_rank
    el, me = C.shape[1] // ep, topo.expert_slot
    slot, first = slot_of(topo), topo.rank - me
    node = topo.rank // topo.local_size
    remote = lambda rank: rank // topo.local_size != node       # noqa: E731
    mine = slice(i * el, (i + 1) * el)
    rows = 0
    for j in range(ep):                                          # EP-AlltoAll out and back
        if remote(first + slot(j, s)):
            rows += int(C[me, j * el:(j + 1) * el].sum()) + int(C[slot(j, s), mine].sum())
    sizes = [int(sum(C[slot(j, t), mine].sum() for j in range(ep))) for t in range(esp)]
    for t in range(esp):                                         # ESP-AllGather, -ReduceScatter
        if t != s and remote(first + slot(i, t)):
            rows += sizes[s] + sizes[t]
    mp_first = topo.rank - topo.mp_rank
    for m in range(topo.mp_size):                                # MP-AllGather
        if m != topo.mp_rank and remote(mp_first + m):
            rows += mp_rows[topo.mp_rank]
    return rows
