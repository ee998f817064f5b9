"""HECATE Algorithm 1 (sparse materialization, Section 4.2) on hand-made loads: both branches,
slots by load, node priority, the w = 5 window, t from the bandwidth, calibration."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeflow.errors import ConfigError
from moeflow.strategies.fssdp import Placement
from moeflow.strategies.fssdp.materialize import (LoadWindow, _apportion, calibrate,
                                                  link_bandwidth, overlap_degree,
                                                  predicted_latency, replicas_per_device,
                                                  sparse_materialize)
from moeflow.strategies.fssdp.options import FSSDPOptions

P = Placement.even(8, 4)                    # rank r owns 2r, 2r + 1; nodes {0, 1}, {2, 3}
LOADS = np.array([100, 50, 10, 10, 5, 5, 30, 5], dtype=float)


def test_branch_t_le_m_replicates_top_t_everywhere():
    got = sparse_materialize(P, LOADS, t=2, m=3, local_size=2)
    assert got.holders[0] == got.holders[1] == frozenset(range(4))     # top 2 by load
    assert all(got.holders[e] == P.holders[e] for e in range(2, 8))
    assert got.owners == P.owners


def test_t_zero_and_t_clamped_to_the_experts():
    assert sparse_materialize(P, LOADS, t=0, m=5, local_size=2) == P
    everywhere = sparse_materialize(P, LOADS, t=100, m=100, local_size=2)   # min(t, |E|)
    assert all(h == frozenset(range(4)) for h in everywhere.holders)


def test_branch_t_gt_m_distributes_slots_by_load_within_memory():
    got = sparse_materialize(P, LOADS, t=3, m=1, local_size=2)
    reps = replicas_per_device(got)
    assert reps.max() <= 1 and reps.sum() == 4                         # totSlots = |D| * m
    n = [len(got.holders[e]) - 1 for e in (0, 6, 1)]                   # top 3: 100, 30, 50
    assert n[0] >= n[2] >= n[1] and n[0] >= 2                          # more load, more slots
    untouched = [e for e in range(8) if e not in (0, 1, 6)]
    assert all(got.holders[e] == P.holders[e] for e in untouched)


def test_replicas_go_to_nodes_without_the_expert_first():
    loads = np.zeros(8)
    loads[0] = 10.0                        # expert 0 lives on node 0 (rank 0)
    got = sparse_materialize(P, loads, t=2, m=1, local_size=2)
    assert sparse_materialize(P, loads, t=1, m=0, local_size=2) == P   # m = 0: no slots
    assert sparse_materialize(P, loads, t=2, m=np.array([1, 1, 1, 1]), local_size=2) == got
    only = sparse_materialize(P, loads, t=2, m=np.array([0, 1, 1, 0]), local_size=2)
    # expert 0 (all the load) first gets node 1 (rank 2, no copy there), then rank 1
    assert 2 in only.holders[0]
    two = sparse_materialize(P, np.array([10, 0, 0, 0, 0, 0, 0, 1.0]), t=2,
                             m=np.array([0, 1, 0, 1]), local_size=2)
    assert 3 in two.holders[0]             # rank 1 (own node) only after node 1 is used


def test_node_priority_single_replica():
    loads = np.array([0, 0, 0, 0, 0, 0, 0, 9.0])      # expert 7 lives on rank 3 (node 1)
    got = sparse_materialize(P, loads, t=2, m=np.array([1, 1, 1, 0]), local_size=2)
    # 3 slots, expert 7 can take 3 more holders: node 0 first (ranks 0 and 1), then rank 2
    assert got.holders[7] == frozenset({0, 1, 2, 3})
    small = sparse_materialize(P, np.array([0, 0, 0, 0, 0, 0, 1.0, 9.0]), t=2,
                               m=np.array([1, 0, 1, 0]), local_size=2)
    assert 0 in small.holders[7]           # the other node before rank 2 of its own node


def test_apportion_is_proportional_capped_and_complete():
    assert _apportion(8, np.array([10.0, 5, 1, 1]), np.array([3, 3, 3, 3])).tolist() == \
        [3, 3, 1, 1]
    assert _apportion(4, np.array([100.0, 50, 10, 10]), np.array([3, 3, 3, 3])).tolist() == \
        [3, 1, 0, 0]
    assert _apportion(5, np.array([1.0, 1]), np.array([1, 1])).sum() == 2      # caps bind
    assert _apportion(0, np.array([1.0]), np.array([3])).tolist() == [0]


def test_deterministic():
    a = sparse_materialize(P, LOADS, t=3, m=1, local_size=2)
    b = sparse_materialize(P, LOADS.copy(), t=3, m=1, local_size=2)
    assert a == b


def test_window_of_five_iterations():
    win = LoadWindow(2)
    assert win.estimate() is None
    for i in range(7):
        win.add([i, 10 * i])
    assert len(win) == 5
    np.testing.assert_allclose(win.estimate(), [4.0, 40.0])             # mean of 2..6
    copy = LoadWindow(2)
    copy.load_state_dict(win.state_dict())
    np.testing.assert_allclose(copy.estimate(), win.estimate())
    with pytest.raises(ConfigError):
        LoadWindow(2, w=0)


def test_overlap_degree_formula():
    # t = T_non-MoE * bw / expert_size: 10 ms at 1 Gbit/s (125 MB/s) of 0.5 MB experts = 2.5
    assert overlap_degree(0.010, 125e6, 500_000) == 2
    assert overlap_degree(0.0, 125e6, 500_000) == 0


def test_link_bandwidth_reads_the_inter_node_fit(tmp_path):
    path = tmp_path / "links.json"
    fit = dict(op="p2p", group_size=2, concurrent_groups=2, alpha_s=1e-4, r2=1.0,
               max_rel_err=0.0, points=[])
    path.write_text(json.dumps({"schema": "moeflow.links/1", "fits": [
        dict(fit, group="inter", beta_s_per_byte=8e-9, bandwidth_Bps=1.25e8),
        dict(fit, group="intra", beta_s_per_byte=1e-10, bandwidth_Bps=1e10),
        dict(fit, group="world", beta_s_per_byte=2e-9, bandwidth_Bps=5e8)]}))
    assert link_bandwidth(str(path), hierarchical=True) == pytest.approx(1.25e8)
    assert link_bandwidth(str(path), hierarchical=False) == pytest.approx(5e8)
    with pytest.raises(ConfigError, match="bench links"):
        link_bandwidth(str(tmp_path / "missing.json"), hierarchical=True)


def test_calibration_accepts_only_a_faster_plan():
    counts = np.zeros((4, 8), dtype=np.int64)
    counts[:, 3] = 50                                  # the real load: expert 3, not 0
    counts[:, 0] = 2
    current = sparse_materialize(P, LOADS, t=1, m=1, local_size=2)    # estimate: expert 0 hot
    fast = calibrate(P, current, counts, t=2, m=2, local_size=2, token_s=1e-3,
                     expert_bytes=1000, bandwidth_Bps=1e9)
    assert len(fast.holders[3]) > 1 and all(current.holders[e] <= fast.holders[e]
                                            for e in range(8))
    slow = calibrate(P, current, counts, t=2, m=2, local_size=2, token_s=1e-3,
                     expert_bytes=1000, bandwidth_Bps=1.0)          # 1000 s per extra expert
    assert slow == current


def test_options_refuse_what_algorithm_1_cannot_use():
    with pytest.raises(ConfigError, match="bandwidth"):
        FSSDPOptions(materialize="sparse")
    with pytest.raises(ConfigError, match="calibrate"):
        FSSDPOptions(calibrate=True)
    with pytest.raises(ConfigError, match="window"):
        FSSDPOptions(materialize="sparse", overlap_degree=1, window=0)
    with pytest.raises(ConfigError, match="memory_capacity"):
        FSSDPOptions(materialize="sparse", overlap_degree=1, memory_capacity=-1)
    assert FSSDPOptions(materialize="sparse", overlap_degree=2).window == 5


def _spent_where_possible(got, loads, t, m):
    """Algorithm 1's budget is spent: a device with a slot left holds every top-t expert."""
    top = sorted(range(len(loads)), key=lambda e: (-loads[e], e))[:t]
    left = [d for d, r in enumerate(replicas_per_device(got)) if r < m]
    return all(d in got.holders[e] for d in left for e in top)


def test_branch_t_gt_m_places_every_slot_a_top_expert_can_use():
    # the apportioned shares (line 9) give an expert more replicas than the devices with a
    # free slot can take; the left-over slot must go to the next candidate, not be dropped
    # (2 nodes x 2; the top 2 are experts 0 (rank 1) and 2 (rank 3), 2 slots each by load)
    owners = Placement([1, 3, 3, 3], world_size=4)
    loads = np.array([8, 6, 7, 5], dtype=float)
    got = sparse_materialize(owners, loads, t=2, m=1, local_size=2)
    assert replicas_per_device(got).sum() == 4                       # |D| * m, none lost
    assert _spent_where_possible(got, loads, 2, 1)


def test_branch_t_gt_m_never_leaves_a_usable_slot_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(300):
        world, local = [(4, 2), (8, 2), (8, 4)][rng.integers(3)]
        E = int(rng.choice([4, 8, 16]))
        owners = Placement([int(x) for x in rng.integers(0, world, E)], world_size=world)
        m = int(rng.integers(1, 4))
        t = int(rng.integers(m + 1, E + 1))
        loads = rng.zipf(1.5, E).astype(float)
        got = sparse_materialize(owners, loads, t=t, m=m, local_size=local)
        assert replicas_per_device(got).max() <= m
        assert _spent_where_possible(got, loads, t, m), (owners.owners, loads, t, m)


def test_calibration_counts_the_all_to_all():
    # node 1's ranks (2, 3) send all their tokens to expert 3, owned on node 0 (rank 1): the
    # expert time is negligible (1 ns per token), so only the all-to-all makes a replica on
    # node 1 worth its extra spAG (1 us per expert at 1 GB/s)
    counts = np.zeros((4, 8), dtype=np.int64)
    counts[2:, 3] = 100
    current = Placement.even(8, 4)
    args = dict(t=1, m=1, local_size=2, token_s=1e-9, expert_bytes=1000, bandwidth_Bps=1e9)
    assert calibrate(P, current, counts, **args) == current          # expert phase only
    moved = calibrate(P, current, counts, row_bytes=4096, **args)   # + dispatch / combine
    assert moved != current and {2, 3} & moved.holders[3]
    before = predicted_latency(current, counts, 2, 1e-9, 4096, 1e9)
    assert before == pytest.approx(200 * 1e-9 + 2 * 200 * 4096 / 1e9)   # rank 1 receives 200
    assert predicted_latency(moved, counts, 2, 1e-9, 4096, 1e9) < before
