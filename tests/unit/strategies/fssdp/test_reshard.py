"""HECATE Algorithm 2 (heterogeneous sharding, Section 4.3) on hand-made loads: equal slots per
device over all layers, underloaded experts first by least-loaded node / device with the
fewer-free-slots tie rule, overlappable experts last."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.reshard import heterogeneous_sharding


def test_hand_worked_case():
    # 2 layers x 4 experts, 2 nodes of 1 device, t = 1 (worked by hand in the comments):
    # layer 1 (its J' max load 4) goes first: e1 -> d0 (tie: node 0), e2 -> d1, e3 -> d1;
    # layer 0: e1 -> d1 (tie on load, d1 has fewer free slots), e2 -> d0, e3 -> d1 (tie, fewer
    # free); then J: layer 0's e0 and layer 1's e0 to the device with the most free slots, d0.
    owners = heterogeneous_sharding([np.array([10, 1, 1, 1.0]), np.array([5, 4, 3, 2.0])],
                                    t=1, world=2, local_size=1)
    assert owners == [[0, 1, 0, 1], [0, 0, 1, 1]]


def test_memory_is_balanced_and_layers_are_heterogeneous():
    rng = np.random.default_rng(0)
    loads = [rng.zipf(1.5, 8).astype(float) for _ in range(3)]
    owners = heterogeneous_sharding(loads, t=2, world=4, local_size=2)
    flat = np.concatenate([np.asarray(o) for o in owners])
    assert np.bincount(flat, minlength=4).tolist() == [6, 6, 6, 6]       # S = 24 / 4
    per_layer = [np.bincount(o, minlength=4).tolist() for o in owners]
    assert any(c != [2, 2, 2, 2] for c in per_layer)                    # heterogeneous


def test_underloaded_experts_spread_over_nodes_by_load():
    loads = [np.array([0, 0, 9, 8, 1, 1, 1, 1.0])]        # t = 0: all underloaded
    owners = heterogeneous_sharding(loads, t=0, world=4, local_size=2)[0]
    # the two heaviest experts land on different nodes (least-loaded node first)
    assert owners[2] // 2 != owners[3] // 2
    assert np.bincount(owners, minlength=4).tolist() == [2, 2, 2, 2]


def test_overlappable_experts_fill_the_rest_and_determinism():
    loads = [np.array([100, 1, 1, 1, 1, 1, 1, 1.0])]
    a = heterogeneous_sharding(loads, t=1, world=4, local_size=2)
    assert a == heterogeneous_sharding([loads[0].copy()], t=1, world=4, local_size=2)
    assert np.bincount(a[0], minlength=4).tolist() == [2, 2, 2, 2]


def test_refuses_unequal_slots():
    with pytest.raises(ConfigError, match="unequal slots"):
        heterogeneous_sharding([np.ones(6)], t=0, world=4, local_size=2)
