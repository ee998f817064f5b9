"""Spawned ranks of tests/multirank/test_fssdp_memory_peak.py: one FSSDP layer's measured peak
of materialization buffers against the formula of moeflow/strategies/fssdp/memory.py (HECATE
Section 4.2's memory capacity ``m``, the buffers of Sections 3.1-3.2's spAG, stacking and spRS).

Each rank builds a float32 layer of 8 experts of 1 MiB each (``d_model`` 64, ``d_expert``
2048: the tokens' activations are a few KiB, so the expert rows dominate), fixes ``P'``
(``materialize="manual"``), runs two warm-up iterations, then one measured forward and backward
under :class:`NewBytes`: the most bytes of storages created in that iteration alive at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from moeflow import MoEConfig, MoELayer, Topology
from tests.helpers.live_bytes import LiveBytes

D_MODEL, D_EXPERT, EXPERTS, TOKENS = 64, 2048, 8, 8

# P' per case: expert e is owned by rank e // 2 (the even shard map on 4 ranks)
PLACEMENTS = {
    "static": [[e // 2] for e in range(EXPERTS)],
    # expert 0 everywhere, expert 2 also on rank 3 (holders and an owner of a hot expert)
    "hot_one": [[0, 1, 2, 3], [0], [1, 3], [1], [2], [2], [3], [3]],
    # rank 0's both experts everywhere: its gradient receive buffers set its peak
    "hot_owner": [[0, 1, 2, 3], [0, 1, 2, 3], [1], [1], [2], [2], [3], [3]],
    # rank 3 holds every other rank's experts (the replicas set its peak)
    "many_replicas": [[0, 3], [0, 3], [1, 3], [1, 3], [2, 3], [2], [3], [3]],
}


class NewBytes(LiveBytes):
    """:class:`LiveBytes` without the storages alive before it (the layer's parameters and
    their gradients, seen again as outputs of views and in-place ops)."""

    def __init__(self, existing):
        super().__init__()
        self.skip = {StorageWeakRef(t.untyped_storage()) for t in existing}

    def _track(self, t) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta \
                and StorageWeakRef(t.untyped_storage()) in self.skip:
            return
        super()._track(t)


def worker(rematerialize: bool) -> dict:
    topo = Topology.from_env(local_size=2)
    cfg = MoEConfig(d_model=D_MODEL, d_expert=D_EXPERT, num_experts=EXPERTS, top_k=1,
                    capacity_factor=None, seed=1, layer_id=0, placement="fssdp",
                    fssdp=dict(materialize="manual", rematerialize=rematerialize))
    layer = MoELayer(cfg, topo)
    x = torch.randn(TOKENS, D_MODEL, generator=torch.Generator().manual_seed(topo.rank))

    def step():
        y = layer(x)
        (y.sum() + layer.aux_loss).backward()

    out = {"row_bytes": layer.experts.expert_bytes, "slot_rows": layer.experts.slots.shape[0]}
    for name, holders in PLACEMENTS.items():
        layer.experts.set_holders(holders)
        for _ in range(2):               # the persistent gradients exist before the measurement
            step()
        dist.barrier()
        existing = [p for p in layer.parameters()] + \
            [p.grad for p in layer.parameters() if p.grad is not None]
        with NewBytes(existing) as probe:
            step()
        out[name] = probe.peak
    return out
