"""``moeflow bench layer --compare``: the comparison logic with a peer that is always present
(moeflow with fixed settings), a peer that computes something else, Tutel's capacity check,
and Tutel itself where it is installed (skipped otherwise: it is not a dependency)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moeflow import ConfigError, MoEConfig, MoELayer
from moeflow.bench import peer as peers
from moeflow.bench.compare import compare_worker, format_compare
from moeflow.cli import main

OPTS = dict(tokens=32, d_model=16, d_expert=24, num_experts=8, top_k=2, capacity_factor=1.25,
            activation="gelu", a2a="auto", schedule="auto", pipeline_degree="auto", warmup=1,
            reps=2)


def test_fixed_peer_agrees_and_reports():
    res = compare_worker("moeflow-fixed", OPTS)
    assert res["agreement"]["agree"] and res["agreement"]["max_abs_diff_y"] == 0.0
    assert len(res["samples_ms"]["moeflow"]) == len(res["samples_ms"]["moeflow-fixed"]) == 2
    assert res["speedup"] == pytest.approx(res["step_ms"]["moeflow-fixed"]
                                           / res["step_ms"]["moeflow"])
    eff = res["efficiency"]
    assert eff["matmul_gflops"] > 0 and eff["experts_fraction"] > 0
    assert "speedup moeflow-fixed/moeflow" in format_compare(res)


class _WrongPeer(peers.FixedMoeflowPeer):
    name = "wrong"

    def build(self, layer):
        m = super().build(layer)
        with torch.no_grad():
            m.experts.w2.mul_(1.01)
        return m


def test_disagreement_is_reported(monkeypatch):
    monkeypatch.setitem(peers.PEERS, "wrong", _WrongPeer())
    res = compare_worker("wrong", OPTS)
    assert not res["agreement"]["agree"] and res["agreement"]["max_abs_diff_y"] > 0


def test_tutel_check_names_the_capacity_mismatch():
    layer = MoELayer(MoEConfig(d_model=8, d_expert=8, num_experts=8, top_k=2,
                               capacity_factor=1.25))
    peers.TutelPeer().check(layer, 64)                      # 2*int(1.25*8) = 20 = ceil(20)
    with pytest.raises(ConfigError, match="same capacity"):
        peers.TutelPeer().check(layer, 60)                  # 2*int(1.25*8) = 20 vs 19


def test_missing_peer_is_skipped_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(peers.TutelPeer, "missing", lambda self: "tutel is not importable")
    assert main(["bench", "layer", "--compare", "tutel"]) == 0
    assert "skipped: tutel is not importable" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("tutel") is None,
                    reason="Tutel is not installed (optional peer; docs/benchmarks/layer.md)")
def test_tutel_computes_the_same_layer():
    res = compare_worker("tutel", OPTS)
    assert res["agreement"]["agree"], res["agreement"]


def test_flops_count_the_kept_rows_when_padding_is_trimmed():
    """With trimmed capacity padding the experts compute the kept rows, not E*C: the FLOP
    count (and the GFLOP/s built on it) must follow."""
    from moeflow.bench.compare import layer_flops
    layer = MoELayer(MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2,
                               capacity_factor=1.25))
    padded = layer_flops(layer, 64)
    trimmed = layer_flops(layer, 64, trimmed_kept=0.75)
    assert padded["rows"] == 4 * 40                   # E * C, C = ceil(1.25 * 64 * 2 / 4)
    assert trimmed["rows"] == 96                      # 0.75 of the 128 choices
    assert trimmed["expert_flops"] / padded["expert_flops"] == 96 / 160


def test_placement_reaches_moeflow_and_is_recorded():
    # --placement auto on one rank: the tuner resolves it to expert parallelism (one rank has
    # no node to deduplicate across) and the row records what was asked and what ran
    res = compare_worker("moeflow-fixed", OPTS | {"placement": "auto"})
    assert res["config"]["placement"] == "auto"
    assert res["moeflow_settings"]["placement"] == "ep"
    assert res["agreement"]["agree"]
    with pytest.raises(SystemExit):
        main(["bench", "layer", "--compare", "moeflow-fixed", "--placement", "dedup"])
