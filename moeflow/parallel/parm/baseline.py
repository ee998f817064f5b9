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

from moeflow.comm.exchange import gather_device_counts, gather_host_ints
from moeflow.config import ConfigError, MoEConfig
from moeflow.dispatch.plan import DispatchPlan
from moeflow.parallel.parm.collectives import esp_all_gather, esp_split
from moeflow.schedule.chunks import block_rows, to_device
from moeflow.schedule.pipeline import ScheduledExperts, scheduled_experts
from moeflow.topology import Topology

# all-to-all algorithms that only use the EP group's own ranks (the hierarchical ones assume
# that EP groups map onto nodes, which ESP changes)
_ESP_ALLTOALLS = ("direct", "pairwise")


def check_parm_layer(cfg: MoEConfig, topo: Topology, hidden: int) -> None:
    """Refuse, with the fix, what the baseline with expert shards cannot run."""
    if topo.esp_size == 1:
        return
    if hidden % topo.esp_size:
        raise ConfigError(
            f"MoEConfig.d_expert={cfg.d_expert} (expert hidden width {hidden}) is invalid for "
            f"esp_size={topo.esp_size}: each expert's hidden dimension is split over the ESP "
            f"group, so it must be a multiple of {topo.esp_size}; change d_expert or esp_size")
    if cfg.a2a not in _ESP_ALLTOALLS:
        raise ConfigError(
            f"MoEConfig.a2a={cfg.a2a!r} is not supported with esp_size={topo.esp_size}: the "
            "hierarchical algorithms assume EP groups laid over nodes, which expert sharding "
            f"changes; use one of {', '.join(_ESP_ALLTOALLS)}")
    if cfg.router == "bilevel":
        raise ConfigError(
            f"MoEConfig.router='bilevel' is not supported with esp_size={topo.esp_size}: "
            "SMILE's node-level routing assumes one expert group per node of the EP group; "
            "use router='topk' or esp_size=1")


def _block_counts(plan: DispatchPlan, topo: Topology) -> np.ndarray:
    """``C[slot][e]``: rows each rank of this EP&ESP block sends to expert e (collective over
    the block; dropless reads the device counts once, capacity sends host integers)."""
    u, E = topo.expert_slots, plan.num_experts
    if plan.capacity is None:
        return gather_device_counts(plan.local_counts, topo.ep_esp_group, u)
    return np.repeat(gather_host_ints([plan.capacity], topo.ep_esp_group, u), E, axis=1)


def baseline_experts(send: torch.Tensor, plan: DispatchPlan, runner: ScheduledExperts,
                     topo: Topology) -> torch.Tensor:
    """Differentiable: this rank's send buffer -> its rows back from the sharded experts."""
    C = _block_counts(plan, topo)
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
