"""A checkpointed MoE layer re-plans nothing (moeflow/plan_record.py), on 4 float64 ranks:
EP at r = 1 and r = 4, the DeepSeek-V3 router, and FSSDP with Algorithm 1 from the load window
(calibration and HECATE-RM on) at r = 1 and r = 4, Parm's S1 (MP = ESP = 2), the
node-deduplicated exchange (2 nodes x 2; trimmed at r = 2, padded at r = 1), each without
checkpointing and under non-reentrant and reentrant torch.utils.checkpoint, 2 AdamW steps
(tests/helpers/recompute_plan_worker.py). The default run covers EP r = 4, DeepSeek-V3,
FSSDP r = 1, Parm S1 and node_dedup; EP r = 1 and FSSDP r = 4 are marked slow (the single-process
tests/unit/core/test_plan_record.py counts EP's forwards and count exchanges at r = 1 and 4)."""

from __future__ import annotations

import pytest
import torch

from moeflow.launch import launch_local
from tests.helpers import recompute_plan_worker as worker

CHECKPOINTED = ("nonreentrant", "reentrant")
SLOW = [v for v in worker.VARIANTS if v not in worker.DEFAULT]


def _launch(variants):
    return launch_local(worker.worker, worker.WORLD, variants, timeout_s=300)


@pytest.fixture(scope="module")
def results():
    return _launch(worker.DEFAULT)


def _close(got, ref, what):
    if isinstance(ref, dict):
        assert got.keys() == ref.keys(), what
        for k in ref:
            _close(got[k], ref[k], f"{what}[{k}]")
    else:
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14, msg=what)


def check_counts(results, variant):
    """Per step: the router runs twice under either checkpoint (once without), and the count
    matrix is exchanged once in every mode (the recomputation reuses the first forward's).
    node_dedup at r >= 2 under the non-reentrant checkpoint keeps its scheduled backward, its
    tasks' graphs saved as they are (moeflow/strategies/node_dedup/backward.py): nothing of
    the layer is recomputed there, the router runs once."""
    for rank, res in results.items():
        for mode in worker.MODES:
            kept = variant == "node_dedup_r2" and mode == "nonreentrant"
            for step, rec in enumerate(res[variant, mode]):
                c = rec["counts"]
                want = 1 if mode == "plain" or kept else 2
                assert c["router_forwards"] == want, (rank, mode, step)
                assert c["count_exchanges"] == 1, (rank, mode, step, c)


def check_parity(results, variant):
    """Outputs, input and parameter gradients, parameters after each AdamW step, and FSSDP's
    P' equal the run without checkpointing, in float64."""
    for rank, res in results.items():
        for mode in CHECKPOINTED:
            for step, (got, ref) in enumerate(zip(res[variant, mode], res[variant, "plain"])):
                for key in ("y", "x_grad", "grads", "dense_grads", "params", "dense_params"):
                    _close(got[key], ref[key], f"rank {rank} {mode} step {step} {key}")
                assert got.get("holders") == ref.get("holders"), (rank, mode, step)


def check_fssdp_plans(results, variant):
    """FSSDP under checkpointing: Algorithm 1 runs once per step (no other P' in the
    recomputation) and the load window gets one entry per step; P' changes over the steps
    (the window matters). Between forward and backward the held experts hold no memory:
    HECATE-RM frees them without checkpointing, and under a checkpoint nothing keeps them
    (the recomputation gathers them again)."""
    for rank, res in results.items():
        for mode in worker.MODES:
            for rec in res[variant, mode]:
                c = rec["counts"]
                assert c.get("placements") == 1 and c.get("window_adds") == 1, (rank, mode, c)
                assert c.get("held_bytes") == 0, (rank, mode, c)
        holders = [rec["holders"] for rec in res[variant, "plain"]]
        assert holders[0] != holders[-1], holders


@pytest.mark.multirank
@pytest.mark.parametrize("variant", worker.DEFAULT)
def test_the_forward_runs_twice_and_the_counts_travel_once(results, variant):
    check_counts(results, variant)


@pytest.mark.multirank
@pytest.mark.parametrize("variant", worker.DEFAULT)
def test_checkpointed_steps_equal_the_plain_ones(results, variant):
    check_parity(results, variant)


@pytest.mark.multirank
def test_fssdp_plans_once_per_step(results):
    check_fssdp_plans(results, "fssdp_sparse_r1")


@pytest.mark.multirank
def test_deepseek_loads_are_counted_once_per_step(results):
    """The DeepSeek-V3 router counts each step's loads once under recomputation (T * k choices
    on this rank), so its bias update (section 2.1.2) sees the plain run's loads."""
    for rank, res in results.items():
        for mode in worker.MODES:
            for rec, ref in zip(res["deepseek_r1", mode], res["deepseek_r1", "plain"]):
                assert rec["loads"] == ref["loads"] == rec["y"].shape[0] * 2, (rank, mode)


@pytest.mark.slow
@pytest.mark.multirank
def test_the_other_variants():
    """EP at r = 1 and FSSDP at r = 4: the same checks."""
    results = _launch(SLOW)
    for variant in SLOW:
        check_counts(results, variant)
        check_parity(results, variant)
        if variant.startswith("fssdp"):
            check_fssdp_plans(results, variant)
