"""``MoEConfig(placement="auto")`` without ranks: the config, which placements are candidates
on which layout (and why not), where the screen measures ``node_dedup``, the pick rule on
injected timings (``node_dedup`` only beyond the noise margin over expert parallelism), the
one-rank resolution, and restoring saved choices. The measured tuning on 2 emulated nodes is
in tests/multirank/test_autotune_placement.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moeflow import autotune
from moeflow.autotune import DEDUP_ROUTE, SIMPLER_MARGIN, TunedChoice, concrete, pick, \
    placement_candidates, restore_tuning, screen_order
from moeflow.config import MoEConfig
from moeflow.errors import ConfigError
from moeflow.layer import MoELayer
from moeflow.strategies import model_hooks, placements, strategy_for
from moeflow.topology import Topology

KW = dict(d_model=8, d_expert=16, num_experts=4, top_k=2)


def _layout(nodes: int, local: int, ep: int | None = None, mp: int = 1, esp: int = 1):
    """What the strategies' checks read of a topology (no process group needed)."""
    world = nodes * local
    return SimpleNamespace(world_size=world, num_nodes=nodes, local_size=local,
                           ep_size=world if ep is None else ep, mp_size=mp, esp_size=esp)


def test_config_takes_auto_and_starts_as_ep():
    cfg = MoEConfig(**KW, placement="auto")
    assert autotune.auto_fields(cfg) == ("placement",)
    assert autotune.placeholder(cfg).placement == "ep"
    assert placements(cfg) == ("ep", "node_dedup")
    assert placements(MoEConfig(**KW, placement="fssdp")) == ("fssdp",)
    assert strategy_for(cfg, Topology.single()).name == "ep"
    assert MoEConfig(**KW, placement="auto", capacity_padding="trim").placement == "auto"
    with pytest.raises(ConfigError, match=r"fssdp.*placement='auto'"):
        MoEConfig(**KW, placement="auto", fssdp={"mode": "static"})
    with pytest.raises(ConfigError, match=r"placement.*'auto'.*did you mean 'auto'"):
        MoEConfig(**KW, placement="autp")


def test_node_dedup_is_a_candidate_only_where_it_runs_and_the_reason_is_kept():
    auto = MoEConfig(**KW, placement="auto")
    assert placement_candidates(MoEConfig(**KW), _layout(2, 2)) == {}     # not auto
    assert placement_candidates(auto, _layout(2, 2)) == {"ep": "candidate",
                                                         "node_dedup": "candidate"}
    for layout, cfg, why in [
            (_layout(1, 4), auto, "several nodes"),
            (_layout(2, 2, ep=2), auto, "ep_size=2"),
            (_layout(2, 2, mp=2), auto, "MP/ESP"),
            (_layout(2, 2), auto.replace(recompute="moe_act"), "recompute"),
            (_layout(2, 2), auto.replace(top_k=1), "top_k=1")]:
        got = placement_candidates(cfg, layout)
        assert got["ep"] == "candidate"
        assert got["node_dedup"].startswith("not a candidate") and why in got["node_dedup"]


def test_the_screen_measures_node_dedup_after_direct_and_before_the_rest():
    args = ("none", "direct", ["fp16"], ["pairwise"], ["sequential", "optsche"], [1, 2])
    assert screen_order(*args, budgeted=True, placements=[DEDUP_ROUTE]) == [
        ("screen", "none", "direct"), ("screen", "fp16", "direct"),
        ("screen", "none", DEDUP_ROUTE), ("overlap", "optsche", 2),
        ("screen", "none", "pairwise")]
    assert screen_order(*args, budgeted=True) == [
        ("screen", "none", "direct"), ("screen", "fp16", "direct"),
        ("overlap", "optsche", 2), ("screen", "none", "pairwise")]


def test_concrete_maps_the_route_to_the_strategy():
    base = autotune.placeholder(MoEConfig(**KW, placement="auto", a2a="auto"))
    dedup = concrete(base, "none", DEDUP_ROUTE, "optsche", 2)
    assert (dedup.placement, dedup.a2a, dedup.schedule, dedup.pipeline_degree) == \
        ("node_dedup", "direct", "optsche", 2)
    ep = concrete(base, "none", "pairwise")
    assert (ep.placement, ep.a2a, ep.schedule) == ("ep", "pairwise", "sequential")


def _m(ms, placement="ep", schedule="sequential", r=1, a2a="direct"):
    return {"measured_ms": ms, "placement": placement, "schedule": schedule,
            "pipeline_degree": r, "a2a": a2a}


def test_pick_keeps_node_dedup_only_beyond_the_margin_over_every_ep_candidate():
    ep, ep_r4 = _m(100.0), _m(97.0, schedule="optsche", r=4)
    within = _m(100.0 / (1 + SIMPLER_MARGIN) + 0.5, "node_dedup")   # just inside the margin
    assert pick([ep, within]) is ep
    beyond = _m(100.0 / (1 + SIMPLER_MARGIN) - 0.5, "node_dedup")
    assert pick([ep, beyond]) is beyond
    # the best EP candidate counts, overlapped or not: its 97 ms are within 5 % of 93 ...
    assert pick([ep, ep_r4, _m(93.0, "node_dedup")])["placement"] == "ep"
    # ... and among node_dedup's own candidates the simplest within the margin wins
    d1, d2 = _m(80.0, "node_dedup"), _m(79.0, "node_dedup", "optsche", 2)
    assert pick([ep, ep_r4, d1, d2]) is d1
    # candidates recorded before placement was tuned count as expert parallelism
    old = {k: v for k, v in ep.items() if k != "placement"}
    assert pick([old, within]) is old


def test_one_rank_resolves_to_ep_with_the_reason_and_reports_it():
    cfg = MoEConfig(**KW, placement="auto", seed=2)
    layer, ref = MoELayer(cfg), MoELayer(cfg.replace(placement="ep"))
    x = torch.randn(10, 8)
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)
    assert layer.tuned.placement == "ep" and layer.tuned.measured_ms is None
    assert layer.tuned.placements["node_dedup"].startswith("not a candidate")
    assert layer.stats["autotune_node_dedup"] == 0.0
    tuned_ep = MoELayer(cfg.replace(placement="ep", a2a="auto"))
    tuned_ep(x)
    assert "autotune_node_dedup" not in tuned_ep.stats        # placement not tuned there


def test_a_choice_saved_before_placement_was_tuned_is_not_restored_into_an_auto_layer():
    auto = nn.Sequential(MoELayer(MoEConfig(**KW, placement="auto", a2a="auto")))
    plain = nn.Sequential(MoELayer(MoEConfig(**KW, a2a="auto")))
    layout = autotune.layout(Topology.single())
    saved = TunedChoice("direct", "sequential", 1, None, None, layout).as_dict()
    old = {k: v for k, v in saved.items() if k not in ("placement", "placements")}
    assert TunedChoice.from_dict(old).placement == "ep"
    assert restore_tuning(plain, {"0": old}) == ["0"]
    assert restore_tuning(auto, {"0": old}) == []            # re-tunes: node_dedup unmeasured
    assert restore_tuning(auto, {"0": dict(saved, placement="ep")}) == ["0"]
    assert auto[0].tuned.placement == "ep" and auto[0].strategy.name == "ep"


def test_block_recompute_check_takes_auto():
    model_hooks.refuse_block_recompute([(0, MoEConfig(**KW, placement="auto"))],
                                       "--recompute full")           # no KeyError, no refusal
