"""Placements (owner map P, materialized P') and HECATE's topology-aware dispatch (Section 4.4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.strategies.fssdp import Placement, candidates, dispatch_plan, rank_loads
from tests.reference.destinations import token_destinations


def test_static_is_owners_and_heterogeneous_sharding():
    p = Placement.static([0, 0, 0, 2, 3], world_size=4)         # rank 1 owns nothing
    assert p.is_static and p.num_experts == 5
    assert p.owned(0) == [0, 1, 2] and p.owned(1) == [] and p.held(2) == [3]
    assert p.holder_chunks() == p.owner_chunks()
    q = p.materialize([{0, 1}, {0}, {0, 3}, {2}, {3, 1, 0}])
    assert not q.is_static and q.owners == p.owners
    assert q.held(1) == [0, 4] and q.replicas(1) == [0, 4] and q.replicas(0) == [4]
    assert q.replicas(3) == [2] and q.owned(3) == [4]
    assert Placement.even(8, 4).owners == (0, 0, 1, 1, 2, 2, 3, 3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(owners=[0, 4], world_size=4), r"owners\[1\]=4"),
    (dict(owners=[0, -1], world_size=4), r"owners\[1\]=-1"),
    (dict(owners=[0, 1.0], world_size=4), r"owners\[1\]=1.0"),
    (dict(owners=[], world_size=4), "at least one expert"),
    (dict(owners=[0], world_size=0), "world_size=0"),
    (dict(owners=[0, 1], holders=[{0}], world_size=2), "1 entries for 2 experts"),
    (dict(owners=[0, 1], holders=[{0}, {0}], world_size=2), r"holders\[1\]=\[0\].*owner 1"),
    (dict(owners=[0, 1], holders=[{0, 5}, {1}], world_size=2), r"holders\[0\] rank=5"),
])
def test_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Placement(**kwargs)


def test_even_refuses_uneven():
    with pytest.raises(ConfigError, match="multiple of the world size 4"):
        Placement.even(6, 4)


# 2 nodes x 2 ranks: node 0 = {0, 1}, node 1 = {2, 3}
P = Placement([0, 1, 2, 3], [{0}, {1, 2}, {2, 0, 3}, {3}], world_size=4)


def test_candidates_follow_section_4_4():
    assert candidates(P, 1, 1, 2) == [1]              # held locally: stays
    assert candidates(P, 0, 1, 2) == [1]              # same-node holder only, not 2
    assert candidates(P, 3, 1, 2) == [2]              # same node as 3
    assert candidates(P, 1, 2, 2) == [0]              # rank 0 on node 0 holds expert 2
    assert candidates(P, 1, 3, 2) == [3]              # only cross-node holder
    assert candidates(P, 0, 3, 2) == [3]
    # one node of 4 ranks: every holder is on the node
    assert candidates(P, 1, 2, 4) == [0, 2, 3]


def test_dispatch_plan_hand_made():
    counts = np.array([[4, 5, 7, 1],
                       [0, 6, 9, 2],
                       [3, 3, 3, 3],
                       [1, 8, 5, 0]])
    plan = dispatch_plan(P, counts, local_size=2)
    assert (plan.sum(2) == counts).all()
    assert plan[0, 1].tolist() == [0, 5, 0, 0]        # node-local holder 1
    assert plan[1, 2].tolist() == [9, 0, 0, 0]        # node-local holder 0 (not 2, 3)
    assert plan[3, 1].tolist() == [0, 0, 8, 0]
    assert plan[1, 3].tolist() == [0, 0, 0, 2]        # cross node
    assert plan[2, 2].tolist() == [0, 0, 3, 0]        # local
    # one node: expert 2's 9 tokens from rank 1 split evenly over holders 0, 2, 3
    flat = dispatch_plan(P, counts, local_size=4)
    assert flat[1, 2].tolist() == [3, 0, 3, 3]
    # 7 tokens of rank 0... rank 0 holds expert 2: local
    assert flat[0, 2].tolist() == [7, 0, 0, 0]
    assert rank_loads(plan).tolist() == plan.sum((0, 1)).tolist()


def test_even_spreading_rotates_remainders():
    # expert 0 held by ranks 2 and 3 (node 1); sources 0 and 1 (node 0) cross nodes
    p = Placement([2, 0, 1, 3], [{2, 3}, {0}, {1}, {3}], world_size=4)
    counts = np.zeros((4, 4), dtype=np.int64)
    counts[0, 0] = counts[1, 0] = 5
    plan = dispatch_plan(p, counts, local_size=2)
    assert plan[0, 0].tolist() == [0, 0, 3, 2]
    assert plan[1, 0].tolist() == [0, 0, 2, 3]        # rank 1's extra token goes to rank 3
    assert rank_loads(plan)[2] == rank_loads(plan)[3] == 5


def test_static_placement_is_expert_parallel():
    p = Placement.even(8, 4)
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 20, size=(4, 8))
    plan = dispatch_plan(p, counts, local_size=2)
    for e in range(8):
        assert (plan[:, e, p.owners[e]] == counts[:, e]).all()


def test_token_destinations_match_the_plan():
    experts = torch.tensor([[2, 1], [2, 3], [2, 0], [1, 2]])
    dest = token_destinations(experts, P, rank=1, local_size=4)
    assert dest.shape == experts.shape
    # rank 1 holds expert 1 (local); expert 2 -> holders 0, 2, 3 evenly, in token order;
    # (4 tokens over 3: rank 1's extra one goes to candidate 1 % 3, rank 2), expert 3 -> 3,
    # expert 0 -> 0 (rank 1's node-mate)
    assert dest.tolist() == [[0, 1], [2, 3], [2, 0], [1, 3]]
    counts = np.zeros((4, 4), dtype=np.int64)
    counts[1] = np.bincount(experts.view(-1).numpy(), minlength=4)
    row = dispatch_plan(P, counts, 4)[1]
    for e in range(4):
        got = np.bincount(dest[experts == e].numpy(), minlength=4)
        assert got.tolist() == row[e].tolist()
        assert all(d in P.holders[e] for d in dest[experts == e].tolist())


def test_dispatch_validation():
    with pytest.raises(ConfigError, match="local_size=3"):
        dispatch_plan(P, np.zeros((4, 4), dtype=np.int64), 3)
    with pytest.raises(ConfigError, match=r"shape \(4, 4\)"):
        dispatch_plan(P, np.zeros((4, 3), dtype=np.int64), 2)
    with pytest.raises(ConfigError, match="non-negative"):
        dispatch_plan(P, -np.ones((4, 4), dtype=np.int64), 2)
    with pytest.raises(ConfigError, match=r"\[0, 4\)"):
        token_destinations(torch.tensor([4]), P, 0, 2)
