"""prepare_model and the replica check of the first sync_gradients."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.launch import launch_local
from tests.helpers import replicas_worker


@pytest.fixture(scope="module")
def results():
    return launch_local(replicas_worker.worker, 4, timeout_s=120)


@pytest.mark.multirank
def test_first_sync_refuses_unequal_replicas(results):
    for rank in range(4):                       # every rank raises, no rank hangs
        err = results[rank]["error_both"]
        assert err is not None, rank
        assert "replicated parameter 'head.weight'" in err
        assert "moeflow.prepare_model(model, topo)" in err
        assert "expert parameter 'moe.experts.w1' of expert-parallel rank 1" in err
        assert "'scale'" not in err             # buffers are broadcast, not checked
        err = results[rank]["error_expert_only"]
        assert err.startswith("the replicas of expert parameter 'moe.experts.w1' of "
                              "expert-parallel rank 1 (equal over its expert-data-parallel "
                              "group, the ranks 1, 3, ...)"), err


@pytest.mark.multirank
def test_prepare_model_broadcasts_replicas_and_keeps_expert_shards(results):
    after = {r: results[r]["after_prepare"] for r in range(4)}
    clean = {r: results[r]["clean"] for r in range(4)}
    for r in range(4):
        for name, value in after[r].items():
            # the same values as a model whose replicas were equal from the start
            torch.testing.assert_close(value, clean[r][name], rtol=0, atol=0,
                                       msg=f"{name} on rank {r}")
            if name.startswith("moe.experts."):
                torch.testing.assert_close(value, after[r % 2][name], rtol=0, atol=0)
            else:
                torch.testing.assert_close(value, after[0][name], rtol=0, atol=0)
    # each EP rank kept its own experts
    assert [results[r]["first_expert"] for r in range(4)] == [0, 2, 0, 2]
    assert not torch.equal(after[0]["moe.experts.w1"], after[1]["moe.experts.w1"])
    assert torch.equal(after[1]["scale"], torch.ones(8, dtype=torch.float64))


def test_world_of_one_has_nothing_to_prepare():
    model = replicas_worker.Net(mf.Topology.single())
    before = [p.detach().clone() for p in model.parameters()]
    assert mf.prepare_model(model, mf.Topology.single()) is model
    mf.check_replicas(model, mf.Topology.single())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
