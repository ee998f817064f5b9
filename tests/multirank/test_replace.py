"""The SmartMoE-style expert re-placement (``MoEConfig(placement="fssdp", fssdp={"replace_every":
2})``, moeflow/strategies/fssdp/replace.py; HECATE Section 2.3's rearrangement peer) on 2 nodes x 2
ranks in float64: outputs, input gradients, expert and dense gradients, parameters and AdamW
moments after every step equal one process's, across two re-placements that move experts
(parameters and optimizer state travel to the new owners); every rank takes the same
assignment, which keeps two experts per rank and lowers the window's most-loaded rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow.launch import launch_local
from moeflow.strategies.fssdp.replace import rank_loads
from tests.helpers import replace_cases as w

TOL = dict(rtol=1e-9, atol=1e-12)
EVEN = [e // 2 for e in range(8)]


@pytest.fixture(scope="module")
def results():
    return launch_local(w.worker, w.WORLD, timeout_s=240)


@pytest.mark.multirank
@pytest.mark.parametrize("case", w.CASES)
def test_matches_one_process_across_replacements(results, case):
    ref = w.reference(case)
    for step in range(w.STEPS):
        seen = set()
        for rank in range(w.WORLD):
            got, want = results[rank][case][step], ref[step]
            label = f"{case} step {step} rank {rank}"
            torch.testing.assert_close(got["y"], want["y"][rank], **TOL, msg=label)
            torch.testing.assert_close(got["x_grad"], w.WORLD * want["x_grad"][rank], **TOL,
                                       msg=label)
            for kind in ("grads", "params", "dense_grads", "dense_params", "state"):
                for key, value in got[kind].items():
                    torch.testing.assert_close(value, want[kind][key], **TOL,
                                               msg=lambda m: f"{kind} {key} {label}: {m}")
            seen |= {e for e, _ in got["params"]}
            assert got["states"] == len([p for p in got["dense_params"]]) + 1   # one slot entry
        assert seen == set(range(8))          # every expert stored once, wherever it lives


@pytest.mark.multirank
@pytest.mark.parametrize("case", w.CASES)
def test_replacement_moves_experts_and_balances_the_window(results, case):
    runs = [[s["owners"] for s in results[r][case]] for r in range(w.WORLD)]
    assert all(run == runs[0] for run in runs)                 # the same on every rank
    steps = results[0][case]
    assert [s["replaced"] for s in steps] == [(i + 1) % w.EVERY == 0 for i in range(w.STEPS)]
    assert steps[0]["owners"] == EVEN
    first = steps[w.EVERY - 1]
    assert first["owners"] != EVEN                             # experts really moved
    for s in steps:
        assert np.bincount(s["owners"], minlength=w.WORLD).tolist() == [2] * w.WORLD
    window = first["window"]
    assert rank_loads(window, first["owners"], w.WORLD).max() < \
        rank_loads(window, EVEN, w.WORLD).max()


@pytest.mark.multirank
def test_gpt_trains_like_ep_across_replacements(results):
    """Two MoE layers sharing one slot tensor: the losses and every expert equal EP's after
    re-placements that moved experts (each layer keeps two experts per rank)."""
    ep_all = {k: v for r in range(w.WORLD) for k, v in results[r]["gpt"]["ep"]["experts"].items()}
    seen = set()
    for rank in range(w.WORLD):
        ep, rp = results[rank]["gpt"]["ep"], results[rank]["gpt"]["replace"]
        torch.testing.assert_close(torch.tensor(rp["losses"]), torch.tensor(ep["losses"]), **TOL)
        for key, value in rp["experts"].items():
            torch.testing.assert_close(value, ep_all[key], **TOL)
        seen |= set(rp["experts"])
        assert rp["owners"] == results[0]["gpt"]["replace"]["owners"]
    assert seen == set(ep_all)
    owners = results[0]["gpt"]["replace"]["owners"]
    assert len(owners) == 2 and any(o != [EVEN, EVEN] for o in owners)
    for o in owners:
        for layer in o:
            assert np.bincount(layer, minlength=w.WORLD).tolist() == [2] * w.WORLD
