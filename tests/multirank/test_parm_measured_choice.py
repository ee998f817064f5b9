"""``parallel_schedule="auto"`` confirmed by measurement (``MoEConfig.parm_auto_measure``,
moeflow/strategies/parm/measured_choice.py; beyond the Parm paper): the calibration rule, the
config field, and on 4 gloo ranks at (N_MP, N_EP, N_ESP) = (2, 1, 2) the confirmation itself
(tests/helpers/parm_measured_cases.py)."""

from __future__ import annotations

import pytest

from moeflow import MoEConfig
from moeflow.config import ConfigError
from moeflow.launch import launch_local
from moeflow.strategies.parm.algorithm1 import AutoSchedule, Prediction
from moeflow.strategies.parm.measured_choice import (PAIRED_MARGIN, Calibration, close_pair,
                                                     predicted_order)
from moeflow.topology import Topology
from tests.helpers import parm_measured_cases as cases

WORLD = 4


def _pred(s1, s2, ted=None, piped=()) -> Prediction:
    best = min([("s1", s1), ("s2", s2)] + ([("ted", ted)] if ted is not None else [])
               + [(f"ted-r{r}", t) for r, t in piped], key=lambda c: c[1])[0]
    return Prediction(best, s1, s2, ted, tuple(piped))


def test_predicted_order_starts_with_algorithm1s_choice():
    p = _pred(3.0, 2.0, 1.0, ((2, 1.5), (4, 1.0)))
    assert predicted_order(p) == ["ted", "ted-r4", "ted-r2", "s2", "s1"]   # ties: ted first
    assert predicted_order(p)[0] == p.schedule


def test_calibration_picks_the_measured_fastest_at_the_confirming_call():
    at = _pred(1.0, 2.0, 3.0)                    # Algorithm 1 alone: s1
    cal = Calibration({"s1": 0.9, "s2": 0.5, "ted": 0.7}, {"s1": 1.0, "s2": 2.0, "ted": 3.0})
    assert at.schedule == "s1" and cal.choose(at) == "s2"
    assert cal.times(at) == pytest.approx({"s1": 0.9, "s2": 0.5, "ted": 0.7})


def test_calibration_scales_each_prediction_by_its_ratio():
    """At other token counts each prediction times its measured / predicted ratio: s2's ratio
    0.25 and ted's 0.5; at the new call s2 predicts 8 (calibrated 2) and ted 3 (calibrated
    1.5): ted wins, which neither the raw prediction (s1 at 1) nor the confirming call's
    measurements (s2 fastest) would take."""
    cal = Calibration({"s1": 2.0, "s2": 0.5, "ted": 1.0}, {"s1": 1.0, "s2": 2.0, "ted": 2.0})
    later = _pred(1.0, 8.0, 3.0)
    assert later.schedule == "s1"
    assert cal.times(later) == pytest.approx({"s1": 2.0, "s2": 2.0, "ted": 1.5})
    assert cal.choose(later) == "ted"


def test_unmeasured_candidates_are_not_weighed():
    """Only s1 was measured (the budget cut the rest): however cheap the others' predictions,
    s1 runs; with nothing measured weighed, Algorithm 1's own choice."""
    cal = Calibration({"s1": 5.0}, {"s1": 1.0})
    assert cal.choose(_pred(1.0, 0.001, 0.0001, ((2, 1e-5),))) == "s1"
    assert Calibration({"ted": 1.0}, {"ted": 1.0}).choose(_pred(1.0, 2.0)) == "s1"


def test_only_aclose_pair_is_timed_again():
    """The two fastest are re-timed in interleaved pairs only when the second is within
    PAIRED_MARGIN of the first; one measured candidate has no pair."""
    m = PAIRED_MARGIN
    assert close_pair({"ted": 1.0, "s1": 1.0 + m / 2, "s2": 0.99}) == ("s2", "ted")
    assert close_pair({"ted": 1.0, "s1": 1.0 + 2 * m}) is None
    assert close_pair({"ted": 1.0}) is None


def test_a_zero_prediction_takes_the_measured_time():
    cal = Calibration({"s1": 0.3, "s2": 0.2}, {"s1": 0.0, "s2": 1.0})
    assert cal.times(_pred(5.0, 2.0)) == pytest.approx({"s1": 0.3, "s2": 0.4})


def test_forced_schedule_is_returned_without_collectives():
    """While the confirmation forces a candidate, choose returns it (no fits, no all-reduce:
    this AutoSchedule has neither fits nor a process group) and changes nothing."""
    auto = AutoSchedule(Topology(rank=0, world_size=4, local_size=2, ep_size=1, mp_size=2,
                                 esp_size=2))
    auto.forced = "ted-r2"
    cfg = MoEConfig(d_model=8, d_expert=8, num_experts=4, parallel_schedule="auto")
    assert auto.choose(cfg, 16, 2, 1.25) == "ted-r2"
    assert auto.last is None and auto.fits is None and auto.choice is None
    assert not auto.measure_pending(cfg)                      # not while one runs
    auto.forced = None
    assert auto.measure_pending(cfg)
    assert not auto.measure_pending(cfg.replace(parm_auto_measure=False))


def test_the_field_is_validated():
    assert MoEConfig(d_model=8, d_expert=8, num_experts=4).parm_auto_measure is True
    with pytest.raises(ConfigError, match=r"parm_auto_measure='yes'.*True.*False"):
        MoEConfig(d_model=8, d_expert=8, num_experts=4, parm_auto_measure="yes")


@pytest.fixture(scope="module")
def results():
    return launch_local(cases.rank_worker, WORLD, timeout_s=240)


@pytest.mark.multirank
def test_no_grad_first_call_uses_algorithm1_alone(results):
    for rank in range(WORLD):
        got = results[rank]["unbounded"]
        assert got["no_grad_measured"] == {} and got["no_grad_choice"] == got["algorithm1"]


@pytest.mark.multirank
def test_every_rank_measures_and_picks_alike(results):
    """Unbounded budget: every candidate measured, in Algorithm 1's order, the same times and
    choice on every rank, the choice the measured fastest; recorded for the benches."""
    got = [results[rank]["unbounded"] for rank in range(WORLD)]
    first = got[0]
    assert list(first["measured"]) == first["order"] and len(first["order"]) == 5
    assert first["cut"] == []
    assert first["choice"] == min(first["measured"], key=first["measured"].get)
    for g in got[1:]:
        assert (g["measured"], g["choice"], g["order"]) == (first["measured"],
                                                           first["choice"], first["order"])
    rec = first["record"]
    assert rec["auto_confirmed"] == first["choice"]
    assert rec["auto_algorithm1"] == first["algorithm1"] == first["order"][0]
    assert rec["auto_measured_ms"] == first["measured"] and rec["auto_confirm_s"] > 0
    assert first["measured_after"] == first["measured"]       # confirmed once


@pytest.mark.multirank
@pytest.mark.parametrize("budget", ["unbounded", "tight"])
def test_outputs_and_gradients_are_the_chosen_schedules(results, budget):
    """float64: the measured layer's output, input gradient and parameter gradients (on top of
    the gradients held before the call) equal the chosen schedule's fixed layer's; the
    confirmation left gradients, RNG, stats, aux loss, timer and Algorithm 1's state as they
    were."""
    for rank in range(WORLD):
        got = results[rank][budget]
        assert got["untouched"]
        assert got["y_diff"] <= 1e-12 and got["x_grad_diff"] <= 1e-12
        assert got["grad_diff"] <= 1e-12


@pytest.mark.multirank
def test_a_tight_budget_measures_algorithm1s_choice_only(results):
    for rank in range(WORLD):
        got = results[rank]["tight"]
        assert list(got["measured"]) == [got["algorithm1"]]
        assert got["cut"] == got["order"][1:] and got["choice"] == got["algorithm1"]
