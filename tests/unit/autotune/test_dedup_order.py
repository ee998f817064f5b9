"""The early-node_dedup rule of the tuner's screen (moeflow/autotune/tuner.py: dedup_place,
screen_order) and the crossing rows it is derived from (moeflow/comm/alltoall/phases.py:
crossing_rows)."""

from __future__ import annotations

import pytest
import torch

from moeflow.autotune import DEDUP_FIRST_SAVING, DEDUP_MIN_SAVING, dedup_place, screen_order
from moeflow.comm.alltoall.phases import crossing_rows

SCHED = ["sequential", "pipelined", "optsche"]
OTHERS = ["bilevel", "hier2d", "node_dedup", "pairwise"]


def test_crossing_rows_per_choice_and_per_node():
    # 2 nodes of 4 experts (0-3: node 0, 4-7: node 1), this rank on node 0; 8: dropped
    ids = torch.tensor([[4, 5],      # both on node 1: 2 rows per choice, 1 per node
                        [0, 6],      # one on node 1: 1 and 1
                        [1, 2],      # both local: 0 and 0
                        [7, 8]])     # one on node 1, one dropped: 1 and 1
    assert crossing_rows(ids, 4, 2, 0) == (4, 3)
    assert crossing_rows(ids, 4, 2, 1) == (3, 2)   # seen from node 1: 0+1+2+0 and 0+1+1+0
    # 4 nodes, k = 4 over 3 other nodes: each token crosses 4 times per choice, 3 per node
    ids = torch.tensor([[2, 3, 4, 6], [5, 7, 2, 3]])
    assert crossing_rows(ids, 2, 4, 0) == (8, 6)


def test_dedup_place():
    assert dedup_place(DEDUP_MIN_SAVING - 0.01, 1e9, 30.0) is None   # small saving: name order
    assert dedup_place(DEDUP_MIN_SAVING, 1.0, 30.0) == "early"
    # uniform top-2 over 2 nodes (0.21), link time 12.3 s per step at 100 Mbit/s and 4096
    # tokens: early, not first (tried first, it ran slower than direct had)
    assert dedup_place(0.21, 12.3, 30.0) == "early"
    assert dedup_place(0.5, 12.3, 30.0) == "first"    # node-limited: 4 x link time > budget
    assert dedup_place(DEDUP_FIRST_SAVING, 7.6, 30.0) == "first"
    assert dedup_place(0.5, 7.4, 30.0) == "early"     # the budget holds two first measurements
    assert dedup_place(0.5, None, 30.0) == "early"    # no link estimate
    assert dedup_place(0.5, 1e9, None) == "early"     # unbounded: everything is screened


@pytest.mark.parametrize("budgeted", [True, False])
def test_screen_order_moves_node_dedup(budgeted):
    args = ("none", "direct", ["fp16"], OTHERS, SCHED, [1, 2, 4], budgeted)
    overlap = [("overlap", "optsche", 2), ("overlap", "optsche", 4)] if budgeted else []
    plain = screen_order(*args)
    assert plain == screen_order(*args, dedup=None)
    assert plain == [("screen", "none", "direct"), ("screen", "fp16", "direct")] + overlap + [
        ("screen", "none", a) for a in OTHERS]
    assert screen_order(*args, dedup="early") == (
        [("screen", "none", "direct"), ("screen", "fp16", "direct")] + overlap
        + [("screen", "none", a) for a in ("node_dedup", "bilevel", "hier2d", "pairwise")])
    # first: node_dedup takes the first place (the lossy codecs are screened on it), and
    # the placeholder's algorithm heads the other algorithms
    assert screen_order(*args, dedup="first") == (
        [("screen", "none", "node_dedup"), ("screen", "fp16", "node_dedup")] + overlap
        + [("screen", "none", a) for a in ("direct", "bilevel", "hier2d", "pairwise")])


def test_screen_order_without_node_dedup_is_unchanged():
    args = ("none", "direct", [], ["pairwise", "pipe"], SCHED, [1, 2], True)
    assert screen_order(*args, dedup="first") == screen_order(*args)
