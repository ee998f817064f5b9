"""After an exception inside a step, the layer drains its communication before the exception
propagates, so a caller that catches it (e.g. skips a step) gets correct results next step."""

from __future__ import annotations

import pytest
import torch

from moeflow.launch import launch_local
from tests.helpers import fault_injection


@pytest.mark.multirank
@pytest.mark.parametrize("capacity_factor", [pytest.param(1.25, marks=pytest.mark.slow), None],
                         ids=["capacity", "dropless"])
def test_step_after_a_caught_error_matches_a_clean_layer(capacity_factor):
    for rank, res in launch_local(fault_injection.recover_worker, 2, capacity_factor,
                                  timeout_s=120).items():
        assert res["raised"], f"rank {rank}: the injected error did not propagate"
        y, gx, grads = res["got"]
        y_ref, gx_ref, grads_ref = res["ref"]
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-12)
        for name in grads_ref:
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=1e-12)
