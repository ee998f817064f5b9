"""The tuner's time budget (MoEConfig.autotune_budget_s): config checks, the clock's
rule, and on 2 gloo ranks in float64 (tests/helpers/autotune_lossy_worker.py): a tiny budget cuts the
tuning short yet gives one valid choice on every rank, the same function as that choice fixed,
in about the time of the two measurements that are always made."""

from __future__ import annotations

import pytest
import torch

from moeflow import ConfigError, MoEConfig
from moeflow.autotune.clock import TuneClock
from moeflow.config import DEFAULT_AUTOTUNE_BUDGET_S
from moeflow.launch import launch_local
from moeflow.topology import Topology

KW = dict(d_model=8, d_expert=8, num_experts=4)


def test_budget_field():
    assert MoEConfig(**KW).autotune_budget_s == DEFAULT_AUTOTUNE_BUDGET_S
    assert MoEConfig(**KW, autotune_budget_s=None).autotune_budget_s is None
    for bad in (0, -1, "30s", True):
        with pytest.raises(ConfigError, match=r"autotune_budget_s=.*> 0"):
            MoEConfig(**KW, autotune_budget_s=bad)


def test_clock_rule():
    clock = TuneClock(None, Topology.single())
    clock.note_step(1e9)
    assert clock.fits(100)                      # unbounded
    clock = TuneClock(10.0, Topology.single())
    clock.note_step(2.0)
    assert clock.fits(4) and not clock.fits(6)
    clock.note_step(0.5)
    assert clock.max_step_s == 2.0 and clock.step_s == 0.5
    clock.note_step(9.0, estimate=False)          # a warm-up or a slow codec's error probe
    assert clock.step_s == 0.5 and clock.max_step_s == 9.0
    first = TuneClock(10.0, Topology.single())
    first.note_step(3.0, estimate=False)          # no estimate yet: the warm-up is one
    assert first.step_s == 3.0


@pytest.fixture(scope="module")
def two_ranks():
    from tests.helpers.autotune_lossy_worker import clock_worker

    return launch_local(clock_worker, 2, timeout_s=240)


@pytest.mark.multirank
def test_tiny_budget_cuts_short_with_one_valid_choice(two_ranks):
    t0, t1 = two_ranks[0]["tiny"]["choice"], two_ranks[1]["tiny"]["choice"]
    keys = ("codec", "a2a", "schedule", "pipeline_degree")
    assert {k: t0[k] for k in keys} == {k: t1[k] for k in keys}
    assert t0["budget_cut"] and t0["budget_cut"] == t1["budget_cut"]
    assert two_ranks[0]["tiny"]["stats"]["autotune_budget_cut"] == 1.0
    assert not two_ranks[0]["free"]["choice"]["budget_cut"]
    # only the two measurements that are always made (a warm-up and one step each) ran: the
    # first (direct, sequential, r = 1) and the first overlap trial (OptSche at r = 4)
    got = [(c["stage"], c["a2a"], c["schedule"], c["pipeline_degree"]) for c in t0["candidates"]]
    assert got == [("screen", "direct", "sequential", 1), ("overlap", "direct", "optsche", 4)]
    for res in two_ranks.values():
        t = res["tiny"]["choice"]
        assert t["tune_s"] <= t["budget_s"] + 4 * t["max_step_ms"] / 1e3 + 0.5
        for k in res["tiny"]["ref"]:
            torch.testing.assert_close(res["tiny"]["got"][k], res["tiny"]["ref"][k],
                                       rtol=1e-12, atol=1e-12)


@pytest.mark.multirank
def test_a_budget_past_the_first_measurement_is_kept_within_one_step(two_ranks):
    for res in two_ranks.values():
        t = res["some"]["choice"]
        # the estimate-based decisions overrun by at most about one step (+ slack for the
        # shared machine's scheduling noise)
        assert t["tune_s"] <= t["budget_s"] + t["max_step_ms"] / 1e3 + 0.5, t
    keys = ("codec", "a2a", "schedule", "pipeline_degree")
    c0, c1 = two_ranks[0]["some"]["choice"], two_ranks[1]["some"]["choice"]
    assert {k: c0[k] for k in keys} == {k: c1[k] for k in keys}


@pytest.mark.multirank
def test_a_budgeted_tuning_measures_the_overlap_trials_before_the_other_algorithms(two_ranks):
    stages = [[(c["stage"], c["a2a"], c["schedule"], c["pipeline_degree"])
               for c in res["roomy"]["choice"]["candidates"]] for res in two_ranks.values()]
    assert stages[0] == stages[1]
    got = stages[0]
    assert got[0] == ("screen", "direct", "sequential", 1)
    assert got[1:3] == [("overlap", "direct", "optsche", 4), ("overlap", "direct", "optsche", 2)]
    others = [g for g in got[3:] if g[0] == "screen"]    # the other algorithms, at r = 1
    assert others and all(g[2:] == ("sequential", 1) for g in others)
    assert not two_ranks[0]["roomy"]["choice"]["budget_cut"]
    for res in two_ranks.values():       # tuning changed speed only: the choice's function
        for k in res["roomy"]["ref"]:
            torch.testing.assert_close(res["roomy"]["got"][k], res["roomy"]["ref"][k],
                                       rtol=1e-10, atol=1e-12)
