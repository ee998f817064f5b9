"""The paired placement screen's decision rule on made-up timings (moeflow/autotune/paired.py):
a real 1.5x gain of node_dedup survives a slow spell on some steps, a tie keeps expert
parallelism, interleaving order and the time budget's cut are as documented."""

from __future__ import annotations

import pytest

from moeflow.autotune import SIMPLER_MARGIN, pick
from moeflow.autotune.paired import PAIRED_REPS, dedup_wins
from moeflow.measure.timing import paired_times


def test_real_gain_survives_a_slow_spell():
    # node_dedup 1.5x faster; a 3x slow spell hits two of five node_dedup steps: the
    # mean of node_dedup's steps (1.2 s) is slower than EP's (1.5 s)
    ep = [1.5, 1.5, 1.5, 1.5, 1.5]
    dedup = [1.0, 3.0, 1.0, 3.0, 1.0]
    assert dedup_wins(ep, dedup, SIMPLER_MARGIN)


def test_spell_shared_by_a_pair_cancels():
    # the spell slows both members of pairs 2-3: the per-pair ratio is still 1.5
    ep = [1.5, 4.5, 4.5, 1.5, 1.5]
    dedup = [1.0, 3.0, 3.0, 1.0, 1.0]
    assert dedup_wins(ep, dedup, SIMPLER_MARGIN)


@pytest.mark.parametrize("gain", [1.0, 1.03, 1.0 + SIMPLER_MARGIN])
def test_tie_keeps_expert_parallelism(gain):
    ep = [gain * t for t in (1.0, 1.1, 0.9, 1.0)]
    assert not dedup_wins(ep, [1.0, 1.1, 0.9, 1.0], SIMPLER_MARGIN)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same non-zero count"):
        dedup_wins([1.0, 1.0], [1.0], SIMPLER_MARGIN)
    with pytest.raises(ValueError, match="same non-zero count"):
        dedup_wins([], [], SIMPLER_MARGIN)
    with pytest.raises(ValueError, match="positive"):
        dedup_wins([1.0], [0.0], SIMPLER_MARGIN)


def test_paired_times_interleave_after_one_warmup_each():
    calls = []

    def ep():
        calls.append("ep")
        return 2.0

    def dd():
        calls.append("dd")
        return 1.0

    e, d = paired_times(ep, dd, PAIRED_REPS, lambda steps: True)
    assert calls == ["ep", "dd"] * (1 + PAIRED_REPS)
    assert e == [2.0] * PAIRED_REPS and d == [1.0] * PAIRED_REPS
    assert PAIRED_REPS > 2
    calls.clear()                    # candidates already warm (Parm's measured auto): no warm-up
    e, d = paired_times(ep, dd, 3, lambda steps: True, warmup=False)
    assert calls == ["ep", "dd"] * 3 and len(e) == len(d) == 3


def test_paired_times_stop_when_the_budget_is_spent():
    asked = []

    def fits(steps):
        asked.append(steps)
        return len(asked) < 2

    e, d = paired_times(lambda: 1.0, lambda: 1.0, 5, fits)
    assert (len(e), len(d)) == (2, 2) and asked == [2, 2]


def _m(placement, ms):
    return {"placement": placement, "codec": "none", "a2a": "direct", "schedule": "sequential",
            "pipeline_degree": 1, "measured_ms": ms}


def test_pick_drops_node_dedup_when_the_paired_screen_keeps_ep():
    measured = [_m("ep", 150.0), _m("node_dedup", 100.0)]
    assert pick(measured)["placement"] == "node_dedup"
    assert pick(measured, dedup_ok=False)["placement"] == "ep"
    assert pick([_m("node_dedup", 100.0)], dedup_ok=False)["placement"] == "node_dedup"
