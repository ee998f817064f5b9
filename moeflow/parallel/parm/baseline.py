"""Parm's baseline schedule (Fig. 3a, Section IV-A / Eq. 1): DeepSpeed-MoE's order.

ESP-AllGather -> EP-AlltoAll -> expert shards -> ESP-AllReduce -> EP-AlltoAll -> ESP-Split.

Rank (ep i, esp s) gates its own tokens and builds its send buffer exactly as without ESP, so
capacity is computed per local batch (``T = k f B L / E`` with the local ``B L``, Parm Section
II-A, and GShard). The ESP-AllGather then gathers the send buffers of the ESP group, which
holds the same rows as gathering the inputs ``I`` and gating each peer's batch separately, and
leaves the gate's work and gradient on the rank that owns the tokens. The gathered rows are put
in expert-major order and go through the ordinary EP exchange (``schedule.pipeline``: codecs,
all-to-all algorithm, chunks and scheduler unchanged); every ESP rank of EP position j receives
the same rows, computes its hidden-dimension shard and the ESP-AllReduce inside the experts
(``ExpertFFN(reduce=...)``) sums the partial outputs. After the EP-AlltoAll back, ESP-Split
keeps this rank's rows. With ``mp_size > 1`` the MP group's ranks hold the same tokens and the
experts compute them once per MP rank: the duplicated work of Eq. (1), as DeepSpeed-MoE does.
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.dispatch.plan import DispatchPlan
from moeflow.parallel.parm.collectives import esp_all_gather, esp_split
from moeflow.parallel.parm.ep_esp import block_counts
from moeflow.schedule.chunks import block_rows, to_device
from moeflow.schedule.pipeline import ScheduledExperts, scheduled_experts
from moeflow.topology import Topology

def baseline_experts(send: torch.Tensor, plan: DispatchPlan, runner: ScheduledExperts,
                     topo: Topology) -> torch.Tensor:
    """Differentiable: this rank's send buffer -> its rows back from the sharded experts."""
    C = block_counts(plan, topo)
    ep, esp, me_ep, me_esp = topo.ep_size, topo.esp_size, topo.ep_rank, topo.esp_rank
    slot = (lambda i, s: i * esp + s) if topo.esp_in_node else (lambda i, s: s * ep + i)
    peers = C[[slot(me_ep, s) for s in range(esp)]]                  # (esp, E)
    sizes = peers.sum(1).tolist()
    # EP-group count matrix of the gathered buffers: EP rank i sends its ESP group's rows
    counts = np.stack([C[[slot(i, s) for s in range(esp)]].sum(0) for i in range(ep)])
    gathered = esp_all_gather(send, sizes, me_esp, topo.esp_group)     # ESP-AllGather
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
