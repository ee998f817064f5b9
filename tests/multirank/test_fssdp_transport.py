"""MoEConfig.fssdp.transport (HECATE Section 3.1 / Section 5) and overlap_backward (Section
3.2): the grouped-broadcast spAG / spRS, the "auto" choice and the spRS on the lane give the
point-to-point layer's outputs, gradients and parameters after AdamW steps in float64 on 4
ranks (early spAG and re-materialization on); a 2-layer GPT trains the same with the spRS on
the lane."""

from __future__ import annotations

import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.launch import launch_local
from moeflow.strategies.fssdp.options import FSSDPOptions
from tests.helpers import fssdp_transport_worker as tw

TOL = dict(rtol=1e-12, atol=1e-14)


@pytest.fixture(scope="module")
def results():
    return launch_local(tw.worker, 4, timeout_s=120)


@pytest.mark.multirank
@pytest.mark.parametrize("transport", ["broadcast", "auto", "p2p_overlap",
                                       "broadcast_overlap"])
def test_transport_matches_point_to_point(results, transport):
    for rank, got in results.items():
        for step, (a, b) in enumerate(zip(got["p2p"], got[transport])):
            label = f"{transport} rank {rank} step {step}"
            torch.testing.assert_close(b["y"], a["y"], **TOL, msg=lambda m: f"y {label}: {m}")
            torch.testing.assert_close(b["x_grad"], a["x_grad"], **TOL,
                                       msg=lambda m: f"x_grad {label}: {m}")
            for kind in ("grads", "params"):
                assert sorted(b[kind]) == sorted(a[kind])
                for key, v in b[kind].items():
                    torch.testing.assert_close(v, a[kind][key], **TOL,
                                               msg=lambda m: f"{kind} {key} {label}: {m}")


@pytest.mark.multirank
def test_experts_move_and_the_choice_is_recorded(results):
    stats = [got["broadcast"][0]["stats"] for got in results.values()]
    assert sum(s["spag_send_bytes"] for s in stats) > 0          # replicas were broadcast
    assert all(s["fssdp_transport_broadcast"] == 1.0 for s in stats)
    assert all("fssdp_transport_broadcast" not in got["p2p"][0]["stats"]
               or got["p2p"][0]["stats"]["fssdp_transport_broadcast"] == 0.0
               for got in results.values())
    auto = [got["auto"][-1]["stats"] for got in results.values()]
    keys = ("fssdp_transport_broadcast", "fssdp_auto_p2p_ms", "fssdp_auto_broadcast_ms")
    assert all(a[k] == auto[0][k] for a in auto for k in keys)    # one decision, every rank
    p2p_ms, bc_ms = auto[0]["fssdp_auto_p2p_ms"], auto[0]["fssdp_auto_broadcast_ms"]
    assert p2p_ms > 0 and bc_ms > 0
    assert auto[0]["fssdp_transport_broadcast"] == float(bc_ms < p2p_ms)


@pytest.mark.multirank
def test_overlapped_sprs_moves_the_same_bytes(results):
    # a forward's stats hold the previous backward's spRS bytes: step 1 has step 0's
    for got in results.values():
        a, b = got["p2p"][-1]["stats"], got["p2p_overlap"][-1]["stats"]
        assert b["sprs_send_bytes"] == a["sprs_send_bytes"]
    assert sum(got["p2p_overlap"][-1]["stats"]["sprs_send_bytes"]
               for got in results.values()) > 0
    for got in results.values():        # the lane ran them (one per backward), p2p did not
        assert got["p2p_overlap"][-1]["sprs_on_lane"] == tw.STEPS
        assert got["broadcast_overlap"][-1]["sprs_on_lane"] == tw.STEPS
        assert got["p2p"][-1]["sprs_on_lane"] == 0


@pytest.mark.multirank
def test_gpt_with_sprs_on_the_lane_trains_the_same(results):
    for rank, got in results.items():
        a, b = got["gpt"][False], got["gpt"][True]
        assert a["sprs_on_lane"] == [0, 0] and b["sprs_on_lane"] == [2, 2]   # 2 steps
        torch.testing.assert_close(b["losses"], a["losses"], **TOL)
        for n, v in b["params"].items():
            torch.testing.assert_close(v, a["params"][n], **TOL,
                                       msg=lambda m: f"rank {rank} {n}: {m}")


def test_transport_option_is_validated():
    assert FSSDPOptions().transport == "p2p"
    with pytest.raises(ConfigError, match=r"fssdp.transport='nccl' is invalid: choose one of "
                                          r"p2p, broadcast, auto"):
        FSSDPOptions(transport="nccl")
    assert FSSDPOptions.coerce({"transport": "auto"}).transport == "auto"
    with pytest.raises(ConfigError, match=r"fssdp.overlap_backward='yes' is invalid"):
        FSSDPOptions(overlap_backward="yes")
