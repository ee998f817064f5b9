"""Parm's baseline schedule (Fig. 3a, Section IV-A / Eq. 1): DeepSpeed-MoE's order and volumes.

ESP-AllGather -> EP-AlltoAll -> expert shards -> ESP-AllReduce -> EP-AlltoAll -> ESP-Split,
with the ESP-AllGather only where the ESP peers hold different tokens. Two cases, fixed by the
layout (:func:`esp_peers_share_tokens`), and a third, MP with whole experts (``N_MP > 1``,
``N_ESP = 1``: DeepSpeed-MoE 0.8.1's duplicate-token drop), in :mod:`.baseline_mp`:

* **The ESP group lies inside the MP group** (``N_ESP = 1`` without MP, or DeepSpeed-MoE's only
  ESP layout: its experts are tensor parallel over the MP group). The peers already hold the same
  (MP-replicated) tokens, so nothing is gathered, as in DeepSpeed-MoE 0.8.1
  (``MOELayer.forward`` skips ``drop_tokens`` / ``gather_tokens`` with tensor-parallel
  experts): each rank gates and dispatches its own copy, its ``E C M`` send buffer goes
  straight into the EP-AlltoAll, every peer's shards compute their hidden slice of the same
  rows, the ESP-AllReduce (Megatron's ``g``) sums them, and in backward the shards' partial
  input gradients are all-reduced (Megatron's ``f``; :class:`.collectives.EspReduce`). The
  exchange is the plain expert-parallel one (``schedule.pipeline``: codecs, chunks,
  schedulers, shared experts as task S). Volumes per rank, forward and backward: EP-AlltoAll
  ``E C M`` x 2, ESP-AllReduce ``E C M``: 0.8.1's (docs/benchmarks/parm.md, the traces).
* **The ESP peers hold different tokens** (``N_MP = 1``, or ESP groups across MP groups; no
  DeepSpeed-MoE version has this layout): Eq. 1's ESP-AllGather of the input ``I``
  (``B L x M`` per peer: each token this rank dispatched, one row per token, zero for a token
  whose every choice was dropped), with the peers' row maps (``int64``, one per send row).
  Every rank rebuilds the peers' send buffers from the gathered rows, so each peer's tokens are
  gated once, by their owner, with its local capacity (Parm Section II-A, GShard), and the
  gate's work and gradient stay with the owner. The rows go expert-major through the EP
  exchange (``E C M N_ESP`` per rank, Eq. 1), the ESP-AllReduce inside the experts sums the
  shards, and ESP-Split keeps this rank's rows. Backward: ESP-Split's AllGather of the rows'
  gradients (``E C M N_ESP``; Eq. 1's token-level split would gather ``B L M N_ESP``, but
  that needs the peers' gates on every rank), the EP-AlltoAlls back, and the ESP-AllGather's
  ReduceScatter (``B L M`` per peer). The peers' token counts (which size the input gather)
  travel as host integers over the group's gloo side; the gathered row maps stay on the device
  (the rebuild is an index on the device), so capacity mode reads nothing back.

With ``mp_size > 1`` an MP group's tokens go through the experts once per ESP group holding a
copy of them: ``N_MP / N_ESP`` times where the ESP group lies inside the MP group (once in
DeepSpeed's ``N_ESP = N_MP``, each shard computing its slice; once with whole experts, whose
duplicates are dropped), ``N_MP`` times otherwise: the duplicated work of Section III-A that
S1 / S2 remove.

With ESP shards both cases keep the capacity layout under ``MoEConfig.capacity_padding="trim"``
(:mod:`.padding`): the ESP-AllReduce sums the peers' partial outputs row by row, which the
``E C`` rows keep aligned whatever the routing, and Eq. 1's gather rebuilds the peers' buffers
from their capacity layout. With whole experts (``N_ESP = 1``) the plan is trimmed.
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.comm.exchange import gather_host_ints
from moeflow.dispatch.plan import DispatchPlan
from moeflow.dispatch.permute import _maps
from moeflow.strategies.parm.collectives import EspReduce, _gather, esp_all_gather, esp_split
from moeflow.strategies.parm.ep_esp import block_counts
from moeflow.schedule.chunks import block_rows, to_device
from moeflow.schedule.pipeline import ScheduledExperts, scheduled_experts
from moeflow.topology import Topology


def esp_peer_ranks(topo: Topology) -> list[int]:
    """Global ranks of this rank's ESP group, in ESP order (the mesh's layout, topology.py)."""
    first, ep, esp, i = topo.rank - topo.expert_slot, topo.ep_size, topo.esp_size, topo.ep_rank
    return [first + (i * esp + s if topo.esp_in_node else s * ep + i) for s in range(esp)]


def esp_peers_share_tokens(topo: Topology) -> bool:
    """True when every ESP peer is in this rank's MP group (so holds the same tokens)."""
    return all(q // topo.mp_size == topo.dp_rank for q in esp_peer_ranks(topo))


def esp_reduce(topo: Topology) -> EspReduce:
    """The experts' ESP-AllReduce for this layout (replicated rows when the peers share
    tokens: the first case of the module docstring)."""
    return EspReduce(topo.esp_group, topo.esp_size, esp_peers_share_tokens(topo))


def _token_rows(send: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input rows as dispatched, ``(T, M)`` (a token's row from its first send row;
    zero for a token with no kept choice; differentiable in ``send``), and the row map
    ``[token of send row 0, ...]`` (``T`` for an empty row), int64, on the device (built there:
    no host-to-device copy)."""
    T, S = plan.num_tokens, send.shape[0]
    dev = send.device
    if T == 0 or S == 0:
        tok = torch.full((S,), T, dtype=torch.long, device=dev)
        return send.new_zeros(T, send.shape[1]) + send.sum() * 0, tok
    m = _maps(plan)
    tok = m.token_of_row.long()
    if m.valid_row is not None:
        tok = torch.where(m.valid_row, tok, torch.full_like(tok, T))
    first = torch.full((T + 1,), S, dtype=torch.long, device=dev).scatter_reduce_(
        0, tok, torch.arange(S, device=dev), "amin")[:T]
    padded = torch.cat([send, send.new_zeros(1, send.shape[1])])
    return padded.index_select(0, first), tok


def gathered_send_buffers(send: torch.Tensor, plan: DispatchPlan, sizes: list[int],
                          tokens: list[int], me: int, group) -> torch.Tensor:
    """Eq. 1's ESP-AllGather of the input: every peer's send buffer (``sizes[p]`` rows from
    peer p, in peer order), rebuilt here from the peers' gathered input rows and row maps.
    ``tokens[p]``: peer p's token count (host integers, :func:`peer_tokens`). The row maps stay
    on the device: nothing is read back (Parm Section IV-A's baseline, no host wait)."""
    rows, meta = _token_rows(send, plan)
    metas = _gather(meta, sizes, group)                             # row maps (int64)
    inputs = esp_all_gather(rows, tokens, me, group)                # ESP-AllGather (B L M)
    heads, offs = np.cumsum([0] + list(sizes)), np.cumsum([0] + list(tokens))
    total = int(sum(tokens))
    # peer p's row r -> row offs[p] + token of the gathered inputs (total: an empty row)
    base = torch.repeat_interleave(
        to_device(offs[:-1], send.device), to_device(sizes, send.device),
        output_size=int(heads[-1]))
    n_of = torch.repeat_interleave(to_device(tokens, send.device),
                                   to_device(sizes, send.device), output_size=int(heads[-1]))
    index = torch.where(metas < n_of, metas + base, torch.full_like(metas, total))
    padded = torch.cat([inputs, inputs.new_zeros(1, inputs.shape[1])])
    return padded.index_select(0, index)


def peer_tokens(plan: DispatchPlan, topo: Topology) -> list[int]:
    """The ESP peers' token counts, host integers, in ESP order: under
    ``MoEConfig.equal_rank_tokens`` (checked on the first call of each count by the capacity
    gather, :class:`~moeflow.dispatch.plan.KnownCapacities`) every peer has this rank's count;
    otherwise one host all-gather over the ESP group (gloo beside NCCL: no device read)."""
    known = plan.known
    if known is not None and known.tokens == plan.num_tokens:
        return [plan.num_tokens] * topo.esp_size
    got = gather_host_ints([plan.num_tokens], topo.esp_group, topo.esp_size)
    return [int(t) for t in got[:, 0]]


def baseline_experts(send: torch.Tensor, plan: DispatchPlan, runner: ScheduledExperts,
                     topo: Topology) -> torch.Tensor:
    """Differentiable: this rank's send buffer -> its rows back from the sharded experts, for
    ESP peers holding different tokens (the module docstring's second case; the first is the
    plain exchange, :meth:`moeflow.strategies.parm.Parm.exchange`)."""
    C = block_counts(plan, topo)
    ep, esp, me_ep, me_esp = topo.ep_size, topo.esp_size, topo.ep_rank, topo.esp_rank
    slot = (lambda i, s: i * esp + s) if topo.esp_in_node else (lambda i, s: s * ep + i)
    peers = C[[slot(me_ep, s) for s in range(esp)]]                  # (esp, E)
    sizes = peers.sum(1).tolist()
    # EP-group count matrix of the gathered buffers: EP rank i sends its ESP group's rows
    counts = np.stack([C[[slot(i, s) for s in range(esp)]].sum(0) for i in range(ep)])
    gathered = gathered_send_buffers(send, plan, sizes, peer_tokens(plan, topo), me_esp,
                                     topo.esp_group)
    # expert-major order of the gathered rows: expert e's rows from peer 0, peer 1, ...
    starts = (np.cumsum(sizes) - sizes)[:, None] + np.cumsum(peers, 1) - peers
    perm = block_rows(starts.T.reshape(-1), peers.T.reshape(-1))
    combined = gathered.index_select(0, to_device(perm, send.device))
    merged = DispatchPlan(plan.num_experts, int(sum(sizes)), plan.top_k, None,
                          to_device(perm, send.device), int(sum(sizes)), plan.dropped,
                          counts=counts, ep_rank=me_ep)
    # EP-AlltoAll, expert shards with the ESP-AllReduce inside, EP-AlltoAll back
    back = scheduled_experts(combined, merged, runner)
    back = back.index_select(0, to_device(np.argsort(perm, kind="stable"), send.device))
    return esp_split(back, sizes, me_esp, topo.esp_group)               # ESP-Split
