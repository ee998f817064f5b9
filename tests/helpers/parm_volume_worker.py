"""Rank worker of tests/multirank/test_parm_baseline_volumes.py: the collectives of one forward + backward
of moeflow's ``baseline`` layer per layout, recorded with the tracer of
``benchmarks.deepspeed.parm_deepspeed_trace`` on the configuration of that module's DeepSpeed
trace (16 tokens per rank, M = 8, E = 4, top-2, f = 2: E x C x M = 512 elements per rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.deepspeed.parm_deepspeed_trace import traced
from moeflow.config import MoEConfig
from moeflow.layer import MoELayer
from moeflow.strategies.parm.baseline import esp_peer_ranks
from moeflow.topology import Topology

TOKENS, M, E = 16, 8, 4
#: name -> (N_MP, N_EP, N_ESP, esp_in_node) on 4 ranks (MP groups: consecutive pairs)
LAYOUTS = {
    "2,2,2": (2, 2, 2, True),      # Parm's Fig. 2, DeepSpeed's ESP = MP layout (the 0.8.1 trace)
    "2,1,2": (2, 1, 2, True),      # ESP = MP, no EP
    "2,2,1": (2, 2, 1, True),      # MP without ESP
    "1,2,2": (1, 2, 2, True),      # ESP peers with different tokens: Eq. 1's ESP-AllGather
    "2,2,2-ep-in-node": (2, 2, 2, False),   # ESP groups across MP groups: likewise
}
#: the same on 8 ranks (worker_8)
LAYOUTS_8 = {"2,4,1": (2, 4, 1, True)}     # MP without ESP, EP across the MP groups' nodes


def topology(layout: str) -> Topology:
    mp, ep, esp, in_node = {**LAYOUTS, **LAYOUTS_8}[layout]
    return Topology.from_env(ep_size=ep, local_size=2, mp_size=mp, esp_size=esp,
                             esp_in_node=in_node)


def esp_ranks(layout: str) -> tuple[list[int], list[int]]:
    """This rank's ESP group: the process group's ranks and the baseline's arithmetic."""
    topo = topology(layout)
    return dist.get_process_group_ranks(topo.esp_group), esp_peer_ranks(topo)


def trace(layout: str) -> list[dict]:
    topo = topology(layout)
    # padded: DeepSpeed 0.8.1's traces are of the E C M capacity buffers
    cfg = MoEConfig(d_model=M, d_expert=2 * M, num_experts=E, top_k=2, capacity_factor=2.0,
                    parallel_schedule="baseline", seed=1, capacity_padding="pad")
    layer = MoELayer(cfg, topo)
    gen = torch.Generator().manual_seed(4000 + topo.dp_rank)      # MP: the same tokens
    x = torch.randn(TOKENS, M, generator=gen).requires_grad_()
    return traced_step(layer, x)


def traced_step(layer: MoELayer, x: torch.Tensor) -> list[dict]:
    """One forward + backward of ``mean(y^2)`` with every collective recorded, each tagged
    with its pass; closes the layer's lane."""
    log, phase = [], ["forward"]
    dist.barrier()
    with traced(log, phase):
        y = layer(x)
        phase[0] = "backward"
        y.square().mean().backward()
    layer.lane.close()
    return log


def checked_plans() -> int:
    """The baseline with ``parm_check_plan=True`` where the ESP group is the MP group: how
    often the check ran in one forward (the ranks' plans agree, so it passes; its refusal is
    tests/multirank/test_plan_agreement.py's)."""
    from moeflow.strategies.parm import strategy

    cfg = MoEConfig(d_model=M, d_expert=2 * M, num_experts=E, top_k=2, capacity_factor=1.0,
                    parallel_schedule="baseline", parm_check_plan=True, seed=1)
    layer = MoELayer(cfg, topology("2,2,2"))
    gen = torch.Generator().manual_seed(4000 + layer.topo.dp_rank)
    calls, check = [], strategy.check_plan_agrees
    strategy.check_plan_agrees = lambda plan, topo: (calls.append(1), check(plan, topo))
    try:
        layer(torch.randn(TOKENS, M, generator=gen)).sum().backward()
    finally:
        strategy.check_plan_agrees = check
    layer.lane.close()
    return len(calls)


def worker() -> dict:
    out = {layout: trace(layout) for layout in LAYOUTS}
    out["checked_plans"] = checked_plans()
    out["esp_ranks"] = {layout: esp_ranks(layout) for layout in LAYOUTS}
    return out


def worker_8() -> dict:
    return {layout: trace(layout) for layout in LAYOUTS_8}
