"""The memory formula of moeflow/strategies/fssdp/memory.py (HECATE Section 4.2's memory
capacity ``m``) against the measured peak: on 4 CPU ranks, the most bytes of tensor storage one
FSSDP layer's forward and backward create and hold at once, for several materialized placements
``P'`` (replicas, hot owners receiving gradient copies), with and without re-materialization,
agree with :func:`~moeflow.strategies.fssdp.memory.layer_peak_rows` within 10 %; and the ``m``
derived from a budget keeps every placement of at most ``m`` replicas per device within it.

The figure is the storages' bytes (tests/helpers/live_bytes.py), not the resident set: it does
not depend on the machine's load, and counts what a device allocator (CUDA's) would reserve;
the resident set is lower by the pages never written (the zeroed halves of autograd's slice
gradients).
"""

from __future__ import annotations

import itertools

import pytest

from moeflow.launch import launch_local
from moeflow.strategies.fssdp.memory import (capacity_from_budget, layer_peak_rows,
                                             worst_peak_rows)
from moeflow.strategies.fssdp.placement import Placement
from tests.helpers import fssdp_memory_worker as mw

_RESULTS: dict[bool, dict] = {}


def _results(rm: bool) -> dict:
    if rm not in _RESULTS:
        _RESULTS[rm] = launch_local(mw.worker, 4, rm, timeout_s=240)
    return _RESULTS[rm]


@pytest.mark.multirank
@pytest.mark.parametrize("rm", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["keep", "rematerialize"])        # one 4-rank launch each
def test_measured_peak_matches_the_formula(rm):
    owners = Placement.even(mw.EXPERTS, 4)
    for rank, got in _results(rm).items():
        row = got["row_bytes"]
        for name, holders in mw.PLACEMENTS.items():
            placement = owners.materialize(holders)
            predicted = layer_peak_rows(placement, rank, got["slot_rows"]) * row
            measured = got[name]
            assert abs(measured - predicted) <= 0.1 * predicted, \
                (f"{name} rank {rank} rm={rm}: measured {measured / 2**20:.2f} MiB, formula "
                 f"{predicted / 2**20:.2f} MiB")


def test_capacity_keeps_every_placement_within_the_budget():
    """Every P' with at most m replicas per device (here: all of them on 4 ranks of 8 experts)
    peaks at most the budget above P' = P on every rank, and m + 1 would break it somewhere
    for a tight budget."""
    owners = Placement.even(8, 4)
    floor = max(layer_peak_rows(owners, r, 2) for r in range(4))
    row = 1000
    for budget_rows in (0, 3, 8, 12, 20):
        m = capacity_from_budget(budget_rows * row, None, None, row, owned=2, world=4,
                                 slot_rows=2, num_experts=8)
        worst = 0
        others = [e for e in range(8)]
        for rank in range(4):                 # rank's replicas: up to m experts it does not own
            for extra in itertools.combinations([e for e in others if e // 2 != rank], m):
                holders = [{e // 2} | ({rank} if e in extra else set()) for e in range(8)]
                worst = max(worst, layer_peak_rows(owners.materialize(holders), rank, 2))
        assert worst - floor <= budget_rows, (budget_rows, m)
        assert (worst_peak_rows(m + 1, 2, 4, 2) - worst_peak_rows(0, 2, 4, 2)) > budget_rows \
            or m == 6
