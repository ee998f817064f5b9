"""Parm S2's plan-agreement check (moeflow/strategies/parm/plan_agreement.py): silent when the
MP ranks route alike, a clear error on every rank (none left waiting) when they do not."""

from __future__ import annotations

import pytest
import torch

from moeflow.config import ConfigError, MoEConfig
from moeflow.dispatch.plan import make_plan
from moeflow.launch import launch_local
from moeflow.strategies.parm.plan_agreement import plan_digest
from tests.helpers import plan_agreement_worker as w


def test_digest_tells_plans_apart():
    e = torch.tensor([[0, 1], [2, 3], [1, 0]])
    a, b = make_plan(e, 4, 2), make_plan(e.flip(0), 4, 2)
    assert plan_digest(a) == plan_digest(make_plan(e.clone(), 4, 2))
    assert plan_digest(a) != plan_digest(b)
    g = torch.Generator().manual_seed(0)
    seen = {tuple(plan_digest(make_plan(torch.randint(0, 8, (32, 2), generator=g), 8, 10)))
            for _ in range(200)}
    assert len(seen) == 200                       # 200 random plans, 200 digests


def test_the_flag_is_validated():
    with pytest.raises(ConfigError, match="parm_check_plan"):
        MoEConfig(d_model=8, d_expert=8, num_experts=4, parm_check_plan=1)


@pytest.mark.slow          # the digest that tells plans apart: test_digest_tells_plans_apart
@pytest.mark.multirank
def test_mp_ranks_that_route_differently_fail_together():
    agree = launch_local(w.run, 4, False, timeout_s=120)
    assert set(agree.values()) == {"ok"}
    differ = launch_local(w.run, 4, True, timeout_s=120)
    assert all("MP ranks' dispatch plans differ" in v for v in differ.values()), differ
