"""Layout parity in float64: world 1 (reference) vs 2 and 4 ranks, EP and EP x expert-DP."""

from __future__ import annotations

import pytest

from moeflow.launch import launch_local
from tests.helpers import parity

LAYOUTS = {2: [2, 1], 4: [4, 2]}          # world -> expert-parallel sizes tried in that job


@pytest.fixture(scope="module")
def results():
    return {world: launch_local(parity.rank_worker, world, list(parity.CASES), eps,
                                timeout_s=120)
            for world, eps in LAYOUTS.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(parity.CASES))
@pytest.mark.parametrize("world,ep", [(w, e) for w, eps in LAYOUTS.items() for e in eps])
def test_layout_parity(results, name, world, ep):
    ref = parity.reference(name, world)
    for rank in range(world):
        parity.assert_rank_matches(results[world][rank][(name, ep)], ref, rank, world,
                                   f"(world {world}, ep {ep})")


def test_reference_is_not_trivial():
    """The cases exercise what they claim: drops happen, hot experts take everything."""
    from moeflow.dispatch import capacity

    layer = parity.make_layer("capacity_k1_tight", parity.Topology.single())
    layer(parity.make_batch("capacity_k1_tight", 1)[0])
    assert layer.stats["dropped_fraction"] > 0
    assert capacity(11, 1, 8, 0.5) == 1
    layer = parity.make_layer("hot_expert_dropless", parity.Topology.single())
    x = parity.make_batch("hot_expert_dropless", 1)[0]
    assert (layer.router(x).experts[:, 0] == 5).all()
