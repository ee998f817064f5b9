"""MoELayer options and input checks: input dtype, scheduler validation, activations by name,
expert biases, per-call top_k / capacity_factor (the float64 layout parity of these options is in
``tests/parity.py``, run by ``test_layer_parity.py``)."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.config import ConfigError
from moeflow.schedule import Scheduler, Task, register_scheduler

BASE = dict(d_model=8, d_expert=16, num_experts=4, top_k=2)


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool])
def test_integer_input_is_refused_with_its_dtype(dtype):
    layer = mf.MoELayer(mf.MoEConfig(**BASE))
    with pytest.raises(TypeError, match=rf"dtype {dtype}; it must be floating point"):
        layer(torch.zeros(3, 8, dtype=dtype))


@register_scheduler("test-forgets-d2")
class ForgetsD2(Scheduler):
    """A broken user scheduler: no D2 tasks (the returned rows would never be decoded)."""

    def order(self, r):
        return [Task(k, i) for i in range(r) for k in ("C1", "D1", "E", "C2")]


@register_scheduler("test-bad-at-r2")
class BadAtTwo(Scheduler):
    """Valid at r = 1, but runs chunk 2's E before its D1 at r >= 2."""

    def order(self, r):
        order = [Task(k, i) for i in range(r) for k in ("C1", "D1", "E", "C2", "D2")]
        if r > 1:
            order[6], order[7] = order[7], order[6]
        return order


def test_bad_user_scheduler_fails_at_construction():
    with pytest.raises(ConfigError, match=r"MoEConfig.schedule='test-forgets-d2' is invalid at "
                                          r"pipeline_degree=2: .*ForgetsD2.order\(2\).*"
                                          r"exactly once"):
        mf.MoELayer(mf.MoEConfig(**BASE, schedule="test-forgets-d2", pipeline_degree=2))


def test_scheduler_is_checked_at_the_configured_degree():
    mf.MoELayer(mf.MoEConfig(**BASE, schedule="test-bad-at-r2"))        # fine at r = 1
    with pytest.raises(ConfigError, match=r"pipeline_degree=2: .*runs E\^2 before D1\^2"):
        mf.MoELayer(mf.MoEConfig(**BASE, schedule="test-bad-at-r2", pipeline_degree=2))


def test_scheduler_is_rechecked_when_the_degree_changes():
    """The profiler replaces ``layer.cfg`` to try other degrees: forward re-validates."""
    layer = mf.MoELayer(mf.MoEConfig(**BASE, schedule="test-bad-at-r2"))
    x = torch.randn(6, 8)
    layer(x)
    layer.cfg = layer.cfg.replace(pipeline_degree=2)
    with pytest.raises(ConfigError, match="pipeline_degree=2"):
        layer(x)
