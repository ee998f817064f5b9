"""Schedulers: valid orders, Theorem 1 against brute force, user-registered schedulers."""

from __future__ import annotations

import random

import pytest
import torch

import moeflow as mf
from moeflow.config import ConfigError
from moeflow.schedule import SCHEDULERS, Scheduler, Task, register_scheduler
from moeflow.schedule.two_lane_model import best_makespan, simulate, valid_orders
from moeflow.schedule.tasks import check_order


def test_optsche_is_eq_12():
    order = [str(t) for t in SCHEDULERS["optsche"]().order(3)]
    assert order == ["C1^1", "C1^2", "C1^3", "D1^1", "E^1", "C2^1", "D1^2", "E^2", "C2^2",
                     "D1^3", "E^3", "C2^3", "D2^1", "D2^2", "D2^3"]


@pytest.mark.parametrize("name", ["sequential", "pipelined", "optsche"])
@pytest.mark.parametrize("r", [1, 2, 4])
def test_builtin_orders_are_valid(name, r):
    check_order(SCHEDULERS[name]().order(r), r)


def test_check_order_rejects_bad_orders():
    with pytest.raises(ValueError, match="exactly once"):
        check_order([Task("C1", 0)], 1)
    bad = SCHEDULERS["optsche"]().order(1)
    bad[0], bad[1] = bad[1], bad[0]
    with pytest.raises(ValueError, match="before C1"):
        check_order(bad, 1)


def _random_times(rng: random.Random):
    """Equal times for tasks of one type (the paper's assumption), random across types."""
    t = {k: rng.uniform(0.05, 5.0) for k in "CADE"}
    return lambda task: t[task.kind[0]]


def test_branch_and_bound_equals_enumeration():
    rng = random.Random(1)
    for _ in range(20):
        times = _random_times(rng)
        exhaustive = min(simulate(o, times)[0] for o in valid_orders(2))
        assert best_makespan(2, times)[0] == pytest.approx(exhaustive)
    assert sum(1 for _ in valid_orders(2)) == 252            # 10! / (5! 5!)


@pytest.mark.parametrize("r,trials", [(2, 200), (3, 12)])
def test_theorem_1_no_valid_order_beats_optsche(r, trials):
    rng = random.Random(r)
    opt = SCHEDULERS["optsche"]().order(r)
    for _ in range(trials):
        times = _random_times(rng)
        best, order = best_makespan(r, times)
        assert simulate(opt, times)[0] <= best + 1e-9, [str(t) for t in order]


def test_overlap_beats_sequential_when_comm_is_large():
    times = _random_times(random.Random(0))
    seq = simulate(SCHEDULERS["sequential"]().order(2), times, overlap=False)[0]
    assert seq == pytest.approx(sum(times(Task(k, i)) for i in range(2)
                                    for k in ("C1", "A1", "D1", "E", "C2", "A2", "D2")))
    assert simulate(SCHEDULERS["optsche"]().order(2), times)[0] < seq


def test_user_scheduler_plugs_into_the_layer():
    """ScheMoE Listing 2: a scheduler registered from Python is used by MoELayer."""
    calls = []

    @register_scheduler("test-reverse-chunks")
    class ReverseChunks(Scheduler):
        def order(self, r):
            calls.append(r)
            return [Task(k, i) for i in reversed(range(r))
                    for k in ("C1", "D1", "E", "C2", "D2")]

    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, schedule="test-reverse-chunks",
                       pipeline_degree=3)
    layer = mf.MoELayer(cfg).double()
    ref = mf.MoELayer(cfg.replace(schedule="sequential", pipeline_degree=1)).double()
    x = torch.randn(9, 8, dtype=torch.float64)
    assert calls == [3]                         # validated at construction (check_order)
    torch.testing.assert_close(layer(x), ref(x))
    assert calls == [3, 3]


def test_bad_schedule_inputs():
    with pytest.raises(ConfigError, match="MoEConfig.schedule='fifo'"):
        mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, schedule="fifo")
    with pytest.raises(ConfigError, match="MoEConfig.pipeline_degree=0"):
        mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, pipeline_degree=0)


@pytest.mark.parametrize("schedule", ["sequential", "optsche"])
@pytest.mark.parametrize("capacity_factor", [1.25, None])
def test_more_chunks_than_tokens_gives_empty_chunks(schedule, capacity_factor):
    """r larger than a rank's rows is legal (a data-dependent error on one rank would leave
    its peers waiting in the all-to-all): the empty chunks change nothing."""
    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2,
                       capacity_factor=capacity_factor, seed=3).replace(schedule=schedule)
    ref = mf.MoELayer(cfg).double()
    layer = mf.MoELayer(cfg.replace(pipeline_degree=8)).double()
    for tokens in (3, 1, 0):
        x = torch.randn(tokens, 8, dtype=torch.float64, requires_grad=True)
        y_ref = ref(x)
        (gx_ref,) = torch.autograd.grad(y_ref.square().sum(), x)
        y = layer(x)
        (gx,) = torch.autograd.grad(y.square().sum(), x)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-12)
