"""The relay's two hops overlapped per source node (DeepEP's normal mode:
:mod:`moeflow.strategies.node_dedup.relay_overlap`) give the rows, order, sums and byte counts of the
one-shot exchange, bit for bit, forward and backward, on 3 emulated nodes x 2 gloo ranks (each
rank's steps reach every other node) with random routings and ranks without tokens, raw in
float64 and through a lossy codec (int8) in float32, with no host synchronisation."""

from __future__ import annotations

import pytest

from moeflow.launch import launch_local
from tests.helpers import node_dedup_overlap_cases as cases

SEEDS = [1, 2, 3, 5]


def _check(got: dict) -> None:
    crossed = 0
    for rank, res in got.items():
        for seed in SEEDS:
            r = res[seed]
            for what in ("dispatch", "combine", "back_combine", "back_dispatch"):
                assert r[what], (rank, seed, what)
            one_shot, overlapped = r["counters"]
            assert one_shot == overlapped, (rank, seed, "inter, non-finite, intra counts")
            assert not r["syncs"], (rank, seed, "host syncs", r["syncs"])
            crossed += r["crossed"]
    assert crossed > 0           # rows did cross between nodes


@pytest.mark.multirank
@pytest.mark.slow
def test_overlapped_hops_equal_the_one_shot_exchange_3x2():
    _check(launch_local(cases.overlap_worker, 6, SEEDS, "none", "float64", True,
                        timeout_s=300))


@pytest.mark.multirank
@pytest.mark.slow
def test_overlapped_hops_equal_the_one_shot_exchange_3x2_int8():
    _check(launch_local(cases.overlap_worker, 6, SEEDS, "int8", "float32", False,
                        timeout_s=300))
