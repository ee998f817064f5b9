"""``moeflow bench hecate-train``'s pieces on one process: every mode builds and trains the same
function (equal losses), the ratios over EP are paired per repetition, and the loads' skew is
read per layer."""

from __future__ import annotations

import pytest

from benchmarks.hecate import hecate_train
from moeflow.config import ModelConfig

SMALL = dict(vocab_size=256, seq_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=24,
             moe_every=2)
SMALL_MOE = dict(num_experts=4, d_expert=8, top_k=2)


def test_every_mode_builds_a_valid_config():
    for mode in hecate_train.MODES:
        cfg = ModelConfig(**SMALL, moe=dict(**SMALL_MOE, capacity_factor=None,
                                            **hecate_train.mode_overrides(mode, 2, 2, 3, 4)))
        assert cfg.moe.placement == ("ep" if mode == "ep" else "fssdp")
    with pytest.raises(ValueError, match="choose from"):
        hecate_train.mode_overrides("flexmoe", 2, 2, 3, 4)


def test_modes_start_with_ep():
    assert hecate_train.parse_modes("ep,hecate") == ["ep", "hecate"]
    for bad in ("hecate,ep", "ep,ep", "ep,nope", ""):
        with pytest.raises(SystemExit, match="--modes"):
            hecate_train.parse_modes(bad)


def test_one_process_runs_every_mode_with_equal_losses():
    opts = dict(preset="tiny", overrides={**SMALL, "moe": SMALL_MOE}, batch_size=2,
                t=1, m=1, reshard_every=1, replace_every=1, warmup=1, reps=2, seed=0,
                init_from=None, modes=list(hecate_train.MODES))
    res = hecate_train.bench_worker(opts)
    s = res["summary"]
    assert list(s) == list(hecate_train.MODES)
    for mode, row in s.items():
        assert row["max_abs_loss_diff_vs_ep"] < 1e-5, mode
        assert len(row["ep_over_mode_paired"]) == 2
        # one process computes every token: its rank carries all of them
        assert row["rank_tokens_max_over_mean"]["median"] == 1.0
    assert s["ep"]["ep_over_mode"]["median"] == 1.0
    counts = res["modes"]["ep"]["expert_counts"]
    assert len(counts) == 3 and len(counts[0]) == 1          # steps x MoE layers
    assert sum(counts[0][0]) == 2 * 8 * 2                     # batch x seq x top-k
    assert "hecate-rm" in hecate_train.format_result(res)


def test_summary_pairs_ratios_per_repetition():
    def mode(times, loss, tokens):
        return {"step_s": times, "cpu_s": times, "loss": loss, "expert_counts": [[[3, 1]]] * 2,
                "rank_tokens": [[tokens]] * 2}
    modes = {"ep": mode([2.0, 4.0], [1.0, 0.5], [3, 1]),
             "hecate": mode([1.0, 4.0], [1.0, 0.5 + 1e-7], [2, 2])}
    s = hecate_train.summarize(modes, {"warmup": 0}, 2, 0)["summary"]
    assert s["hecate"]["ep_over_mode_paired"] == [2.0, 1.0]
    assert s["hecate"]["ep_over_mode"]["median"] == 1.5
    assert s["ep"]["rank_tokens_max_over_mean"]["median"] == 1.5
    assert s["hecate"]["rank_tokens_max_over_mean"]["median"] == 1.0
    assert s["hecate"]["max_abs_loss_diff_vs_ep"] == pytest.approx(1e-7)
