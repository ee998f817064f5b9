"""HECATE-RM (Section 3.2) under bf16 autocast, on 2 gloo ranks (docs/gpu.md, "CUDA-path
review", finding 9): the held experts are materialized in the autocast dtype, so freeing their
storage after the forward frees what autograd saved for the backward (not only an fp32 copy
that no backward reads, with autocast's bf16 copies kept alive), and the gradients equal those
of the layer without re-materialization."""

from __future__ import annotations

import pytest
import torch

from moeflow import Topology
from moeflow.launch import launch_local

WORLD = 2


def _run(rm: bool, topo, dtype) -> dict:
    from tests.helpers import parity
    from tests.helpers.fssdp_layer_worker import batch
    layer = parity.make_layer("hot_expert_dropless", topo, placement="fssdp",
                              fssdp=dict(materialize="manual", rematerialize=rm)).float()
    owners = layer.experts.owners.owners                # every odd expert on both ranks
    layer.experts.set_holders([{o} | ({1 - o} if e % 2 else set())
                               for e, o in enumerate(owners)])
    x, g = batch("hot_expert_dropless", topo.rank, 0)
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x.to(dtype))
        storages = {}
        for t in saved:                                 # distinct storages still allocated
            s = t.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        alive = sum(storages.values())
        parity.local_loss(y.float(), g.float(), layer).backward()
    held = len(layer.experts.last_placement.held(topo.rank))
    return {"alive": alive, "grad": layer.experts.slots.grad.clone(),
            "grad_dtype": layer.experts.slots.grad.dtype, "y": y.detach().float(),
            "held_bf16_bytes": held * layer.experts.numel * 2,
            "spag_backward": layer.experts.bytes.get("spag_backward")}


def worker() -> dict:
    topo = Topology.from_env(local_size=1)
    return {(dtype, rm): _run(rm, topo, dtype) for dtype in (torch.float32, torch.bfloat16)
            for rm in (False, True)}


@pytest.fixture(scope="module")
def results():
    return launch_local(worker, WORLD, timeout_s=240)


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])   # the layer's input dtype
def test_rm_under_bf16_autocast_frees_what_autograd_saved(results, dtype):
    for rank, got in results.items():
        plain, rm = got[dtype, False], got[dtype, True]
        # every held expert's bf16 bytes that the plain layer keeps for the backward are freed
        assert plain["alive"] - rm["alive"] >= rm["held_bf16_bytes"] > 0, (rank, plain, rm)
        assert rm["spag_backward"] is not None                 # and re-gathered for it
        assert torch.equal(plain["y"], rm["y"]), rank
        assert rm["grad_dtype"] == plain["grad_dtype"] == torch.float32
        assert torch.equal(plain["grad"], rm["grad"]), (rank, (plain["grad"] - rm["grad"])
                                                        .abs().max())
