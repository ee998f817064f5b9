"""Importable by spawned ranks: a layer step that fails mid-schedule, then a clean step.

The all-to-all is slowed down unevenly (rank 0 waits before issuing each exchange), so if a
failed step left communication tasks running, the next step's collectives (issued by the main
thread) would interleave with them in a different order on each rank.
"""

from __future__ import annotations

import time

import torch

from moeflow.comm.alltoall import ALLTOALLS, register_alltoall
from moeflow.comm.alltoall.direct import DirectAllToAll


class UnevenDirect(DirectAllToAll):
    def start(self, x, send_splits, recv_splits, matrix=None):
        if self.topo.rank == 0:
            time.sleep(0.3)
        return super().start(x, send_splits, recv_splits, matrix)


if "test-uneven-direct" not in ALLTOALLS:
    register_alltoall("test-uneven-direct")(UnevenDirect)


class Boom(RuntimeError):
    pass


def _step(layer, x):
    x = x.detach().requires_grad_()
    y = layer(x)
    (y.square().sum() + layer.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def recover_worker(capacity_factor) -> dict:
    from moeflow import MoEConfig, MoELayer, Topology

    topo = Topology.from_env()
    cfg = MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, seed=2,
                    capacity_factor=capacity_factor, a2a="test-uneven-direct",
                    schedule="optsche", pipeline_degree=2)
    layer = MoELayer(cfg, topo).double()
    x = torch.randn(10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(topo.rank))
    real = layer.experts.forward
    calls = {"n": 0}

    def failing(*args, **kwargs):              # E of the first chunk raises, on every rank
        calls["n"] += 1
        if calls["n"] == 1:
            raise Boom("injected")
        return real(*args, **kwargs)

    layer.experts.forward = failing
    raised = False
    try:
        _step(layer, x)
    except Boom:
        raised = True
    layer.experts.forward = real
    got = _step(layer, x)
    ref = _step(MoELayer(cfg, topo).double(), x)
    return {"raised": raised, "got": got, "ref": ref}
