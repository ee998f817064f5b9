"""Rank code of tests/multirank/test_replicas.py (importable by spawned ranks)."""

from __future__ import annotations

import torch
from torch import nn

import moeflow as mf
from moeflow.init import seeded_normal

D = 8


class Net(nn.Module):
    """A user's model: its own head (seeded from the global RNG) around an MoE layer."""

    def __init__(self, topo: mf.Topology):
        super().__init__()
        self.head = nn.Linear(D, D)
        self.moe = mf.MoELayer(mf.MoEConfig(d_model=D, d_expert=12, num_experts=4, top_k=2,
                                            capacity_factor=None, seed=5), topo)
        self.register_buffer("scale", torch.ones(D))

    def forward(self, x):
        return self.moe(self.head(x) * self.scale)


def _build(topo: mf.Topology, head_delta: float, expert_delta: float) -> Net:
    torch.manual_seed(0)                   # the same head on every rank, then perturbed
    model = Net(topo).double()
    with torch.no_grad():
        if topo.rank == 1 and head_delta:  # the user's head is not seeded alike everywhere
            model.head.weight[0, 0] += head_delta
            model.scale[3] = 2.0           # a buffer that differs too (not checked: buffers
            #                                such as running statistics may differ by design)
        if topo.rank == 3:                 # the replica of rank 1's expert shard
            model.moe.experts.w1[0, 2, 1] += expert_delta
    return model


def _step(model: Net, topo: mf.Topology) -> dict:
    x = seeded_normal((6, D), 1.0, "replicas", topo.rank, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    (model(x).square().mean() + model.moe.aux_loss).backward()
    mf.sync_gradients(model, topo)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {n: t.detach().clone() for n, t in
            list(model.named_parameters()) + list(model.named_buffers())}


def _first_sync_error(model: Net, topo: mf.Topology) -> str | None:
    try:
        _step(model, topo)
    except mf.ReplicaMismatchError as e:
        return str(e)
    return None


def worker() -> dict:
    topo = mf.Topology.from_env(ep_size=2)      # 4 ranks: EP groups {0,1} {2,3}
    out = {"first_expert": _build(topo, 0, 0).moe.experts.first_expert}
    model = _build(topo, 0.24, 0.5)
    out["error_both"] = _first_sync_error(model, topo)
    out["error_expert_only"] = _first_sync_error(_build(topo, 0.0, 0.5), topo)
    mf.prepare_model(model, topo)
    out["after_prepare"] = _step(model, topo)        # passes the check now
    out["clean"] = _step(_build(topo, 0.0, 0.0), topo)
    return out
