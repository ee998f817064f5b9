"""Parm stage 1: MP+EP+ESP topology, ESP expert shards and the baseline schedule (Fig. 3a)."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoEConfig
from moeflow.config import ConfigError
from moeflow.experts import ExpertFFN
from moeflow.launch import launch_local
from moeflow.topology import Topology
from tests.helpers import parm_cases, parity

WORLD = 4


@pytest.fixture(scope="module")
def results():
    return launch_local(parm_cases.rank_worker, WORLD, list(parm_cases.LAYOUTS), timeout_s=180)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(parm_cases.CASES))
@pytest.mark.parametrize("layout", list(parm_cases.LAYOUTS))
def test_baseline_parity(results, layout, name):
    mp, _, esp, _ = parm_cases.LAYOUTS[layout]
    ref = parm_cases.reference(name, WORLD, mp)
    for rank in range(WORLD):
        assert results[rank][(layout, name)]["shard"][1] == esp
        parm_cases.assert_rank_matches(results[rank][(layout, name)], ref, rank, WORLD,
                                       f"({layout})")


def test_cases_are_not_trivial():
    """Capacity drops tokens, and the MP groups' duplicated batches differ between groups."""
    layer = parity.make_layer("capacity_k2", Topology.single())
    layer(parity.make_batch("capacity_k2", 1)[0])
    assert layer.stats["dropped_fraction"] > 0
    assert not torch.equal(parity.make_batch("capacity_k2", 0)[0][:4],
                           parity.make_batch("capacity_k2", 1)[0][:4])


def test_shard_is_a_slice_of_the_global_expert():
    full = ExpertFFN(6, 8, 2, 3, "swiglu", seed=1, layer_id=4, bias=True)
    for s in range(2):
        part = ExpertFFN(6, 8, 2, 3, "swiglu", seed=1, layer_id=4, bias=True, shard=(s, 2))
        for name, dim in parm_cases.HIDDEN.items():
            torch.testing.assert_close(getattr(part, name),
                                       getattr(full, name).narrow(dim, 4 * s, 4), rtol=0, atol=0)
        torch.testing.assert_close(part.b2, full.b2, rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of the shard count"):
        ExpertFFN(6, 7, 0, 1, shard=(0, 2))


def test_shards_sum_to_the_expert():
    """Partial outputs of the shards (b2 added once after the sum) equal the whole expert."""
    full = ExpertFFN(6, 8, 0, 2, "gelu", seed=3, bias=True).double()
    parts = [ExpertFFN(6, 8, 0, 2, "gelu", seed=3, bias=True, shard=(s, 2),
                       reduce=lambda y: y).double() for s in range(2)]
    x = torch.randn(7, 6, dtype=torch.float64)
    counts = [3, 4]
    partial = sum(p._partial(x, counts) for p in parts)
    b2 = full.b2.repeat_interleave(torch.tensor(counts), dim=0)
    torch.testing.assert_close(partial + b2, full(x, counts), rtol=1e-12, atol=1e-12)


@pytest.mark.multirank
def test_layer_refuses_what_the_baseline_cannot_run(results):
    errors = results[0]["errors"]
    assert "d_expert=13" in errors["hidden"] and "multiple of 2" in errors["hidden"]
    assert "a2a='hier1d'" in errors["a2a"] and "direct" in errors["a2a"]
    assert "router='bilevel'" in errors["bilevel"] and "esp_size=1" in errors["bilevel"]


def test_checkpoints_of_expert_shards_outside_a_layer_are_refused():
    """Shards are stored whole over their layer's ESP mesh (tests/multirank/test_checkpoint_layouts.py);
    shards without a layer have none."""
    from moeflow.checkpoint import checkpoint_state

    model = torch.nn.Sequential(ExpertFFN(4, 8, 0, 2, shard=(1, 2)))
    with pytest.raises(ConfigError, match=r"ESP shards \(1 of 2\) outside a MoELayer"):
        checkpoint_state(model, None, torch.tensor(0))
