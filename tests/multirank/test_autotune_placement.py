"""``MoEConfig(placement="auto")`` on 4 gloo ranks as 2 emulated nodes x 2, float64: the tuner
measures the node-deduplicated exchange beside expert parallelism, every rank keeps the same
one, ``node_dedup`` is kept only where it beats expert parallelism by more than the noise
margin (timings injected), the step after tuning equals the one-process reference whichever
won, an activation checkpoint's recomputation replays the strategy of its forward across a
re-tune, checkpoints load across the two strategies, and on one node ``node_dedup`` is not a
candidate (the record says why)."""

from __future__ import annotations

import pytest
import torch

from moeflow.launch import launch_local
from tests.helpers import parity
from tests.helpers.autotune_placement_worker import CASE


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from tests.helpers.autotune_placement_worker import worker

    return launch_local(worker, 4, str(tmp_path_factory.mktemp("ckpt") / "c"), timeout_s=600)


def _stages(choice: dict) -> set:
    return {m["placement"] for m in choice["candidates"]}


@pytest.mark.multirank
def test_both_placements_measured_one_choice_and_parity(ranks):
    ref = parity.reference(CASE, 4)
    choices = set()
    for rank, res in ranks.items():
        got = res["measured"]
        c = got["choice"]
        assert _stages(c) == {"ep", "node_dedup"}, c["candidates"]
        assert c["placements"] == {"ep": "candidate", "node_dedup": "candidate"}
        assert got["placement"] == got["strategy"] == c["placement"]
        choices.add(c["placement"])
        parity.assert_rank_matches(got, ref, rank, 4, f"placement auto -> {c['placement']}")
    assert len(choices) == 1                                   # every rank alike


@pytest.mark.multirank
def test_node_dedup_kept_only_beyond_the_margin_and_the_step_is_unchanged(ranks):
    ref = parity.reference(CASE, 4)
    for rank, res in ranks.items():
        won = res["dedup_wins"]
        assert won["placement"] == won["strategy"] == "node_dedup", won["choice"]
        assert won["choice"]["pipeline_degree"] == 1       # the simplest of the tied ones
        parity.assert_rank_matches(won, ref, rank, 4, "placement auto -> node_dedup")
        near = res["within_margin"]
        assert near["placement"] == near["strategy"] == "ep", near["choice"]
        parity.assert_rank_matches(near, ref, rank, 4, "placement auto -> ep")


@pytest.mark.multirank
def test_a_recomputation_replays_the_strategy_of_its_forward(ranks):
    """Under an activation checkpoint the layer re-tuned to "ep" between the forward (run
    with node_dedup) and the backward: the recomputation still runs node_dedup, so outputs
    and gradients equal the plain node_dedup step; "ep" is in force afterwards."""
    for rank, res in ranks.items():
        rep = res["replay"]
        assert rep["strategy_after"] == "ep"
        assert rep["plain"].keys() == rep["checkpointed"].keys()
        for k, v in rep["plain"].items():
            torch.testing.assert_close(rep["checkpointed"][k], v, **parity.TOL,
                                       msg=lambda m: f"rank {rank} {k}: {m}")


@pytest.mark.multirank
def test_checkpoints_load_across_the_two_strategies(ranks):
    for rank, res in ranks.items():
        ck = res["checkpoint"]
        assert ck["tuning_calls"] == 0                  # the auto layer restored the choice
        assert ck["auto"]["strategy"] == "node_dedup"
        assert ck["ep"]["strategy"] == "ep" and ck["node_dedup"]["strategy"] == "node_dedup"
        for placement in ("ep", "node_dedup", "auto"):
            assert ck[placement]["params_equal"], (rank, placement)
            torch.testing.assert_close(ck[placement]["y"], ck["y_saved"], **parity.TOL)


@pytest.mark.multirank
def test_one_node_has_no_node_dedup_candidate(ranks):
    for res in ranks.values():
        c = res["one_node"]["choice"]
        assert c["placement"] == "ep" and _stages(c) == {"ep"}
        assert c["placements"]["ep"] == "candidate"
        assert c["placements"]["node_dedup"].startswith("not a candidate")
        assert "node" in c["placements"]["node_dedup"]
