"""``moeflow bench group-limited --algorithms direct,node_dedup`` on 4 gloo ranks as 2 emulated
nodes x 2 (``--local-size 2``): the JSON's fields, the measured inter-node bytes equal to the
ones computed from the routing, and ``node_dedup`` sending fewer bytes than ``direct`` under
node-limited routing (every remote token's k choices on one node: one row instead of k);
``--algorithms direct,node_dedup,auto``: the ``placement="auto"`` row runs the tuner's pick
(its bytes those of the strategy it chose) with its ratios to both forced ones."""

from __future__ import annotations

import pytest
import torch

from benchmarks.deepseek_v3 import group_limited
from moeflow.config import ConfigError
from moeflow.launch import launch_local

OPTS = dict(tokens=48, d_model=16, d_expert=8, experts_per_rank=2, top_k=2,
            algorithms="direct,node_dedup", inter_bw="100mbit", local_size=2, warmup=1,
            reps=2)


def _worker() -> dict:
    torch.set_num_threads(1)
    return group_limited.bench(dict(OPTS))


pytestmark = pytest.mark.slow      # a measurement command; the default run guards its library parts elsewhere


@pytest.fixture(scope="module")
def res():
    return launch_local(_worker, 4, timeout_s=300)[0]


@pytest.mark.multirank
def test_json_fields(res):
    assert res["nodes"] == 2 and res["world"] == 4 and res["inter_bw_bps"] == 100e6
    assert [(r["routing"].split(" ")[0], r["algorithm"]) for r in res["rows"]] == [
        ("top-k", "direct"), ("top-k", "node_dedup"),
        ("group-limited", "direct"), ("group-limited", "node_dedup")]
    for r in res["rows"]:
        assert len(r["step_ms"]) == 2 and r["step_ms_min"] <= r["step_ms_median_slowest"]
        assert r["step_ms_median_slowest"] <= r["step_ms_max"]
        assert not r["inter_node_bytes_varied"]            # the routing does not change
        assert r["inter_node_bytes_per_step"] == r["routing_inter_node_bytes_per_step"] > 0
        assert sum(r["node_egress_bytes_per_step"]) == r["inter_node_bytes_per_step"]
        bound = max(r["node_egress_bytes_per_step"]) * 8 / 100e6 * 1e3
        assert r["link_bound_ms"] == pytest.approx(bound)
    assert [q["routing"].split(" ")[0] for q in res["ratios"]] == ["top-k", "group-limited"]
    for q in res["ratios"]:
        assert len(q["paired"]) == 2 and q["min"] <= q["median"] <= q["max"]


@pytest.mark.multirank
def test_node_dedup_sends_less_under_node_limited_routing(res):
    rows = {(r["routing"].split(" ")[0], r["algorithm"]): r for r in res["rows"]}
    direct, dedup = rows[("group-limited", "direct")], rows[("group-limited", "node_dedup")]
    assert direct["nodes_per_token_other"] <= 1.0             # topk_group=1: one node
    # top-2 on one node: one row (+ 2 gates, 2 ids) instead of two
    assert dedup["inter_node_bytes_per_step"] < 0.6 * direct["inter_node_bytes_per_step"]
    q = res["ratios"][1]
    assert q["bytes_ratio"] == pytest.approx(direct["inter_node_bytes_per_step"]
                                             / dedup["inter_node_bytes_per_step"])


def test_bad_algorithm_is_refused():
    with pytest.raises(ConfigError, match="--algorithms='direct,hier9'.*node_dedup"):
        group_limited.parse_algorithms("direct,hier9")
    assert group_limited.parse_algorithms("direct, node_dedup") == ["direct", "node_dedup"]
    assert group_limited.parse_algorithms("direct,auto") == ["direct", "auto"]


def test_node_limits_are_checked():
    assert group_limited.parse_limits("1, 2,4") == (1, 2, 4)
    for bad in ("", "0", "1,1", "two"):
        with pytest.raises(ConfigError, match="--topk-group=.*topk_group"):
            group_limited.parse_limits(bad)
    labels = [label for label, _ in group_limited.variants(8, (1, 4))]
    assert labels == ["top-k (n_group=1)", "group-limited (n_group=8, topk_group=1)",
                      "group-limited (n_group=8, topk_group=4)"]


def _auto_worker() -> dict:
    torch.set_num_threads(1)
    return group_limited.bench(dict(OPTS, algorithms="direct,node_dedup,auto"))


@pytest.mark.multirank
def test_auto_row_runs_the_tuners_pick_beside_both_forced_ones():
    res = launch_local(_auto_worker, 4, timeout_s=300)[0]
    rows = {(r["routing"].split(" ")[0], r["algorithm"]): r for r in res["rows"]}
    for routing in ("top-k", "group-limited"):
        auto = rows[(routing, "auto")]
        assert auto["placement"] in ("ep", "node_dedup")
        assert auto["tuned"]["placement"] == auto["placement"]
        assert {m["placement"] for m in auto["tuned"]["candidates"]} == {"ep", "node_dedup"}
        forced = rows[(routing, "direct" if auto["placement"] == "ep" else "node_dedup")]
        # it ran the strategy it chose: the same bytes as that one forced
        assert auto["inter_node_bytes_per_step"] == forced["inter_node_bytes_per_step"]
        assert auto["routing_inter_node_bytes_per_step"] == \
            forced["routing_inter_node_bytes_per_step"]
        assert rows[(routing, "direct")]["tuned"] is None
    over = [(q["routing"].split(" ")[0], q["over"].split(" step")[0]) for q in res["ratios"]]
    assert over == [("top-k", "direct / node_dedup"), ("group-limited", "direct / node_dedup"),
                    ("top-k", "auto / direct"), ("top-k", "auto / node_dedup"),
                    ("group-limited", "auto / direct"), ("group-limited", "auto / node_dedup")]
    for q in res["ratios"][2:]:
        assert len(q["paired"]) == 2 and q["min"] <= q["median"] <= q["max"]
        assert q["placement"] == rows[(q["routing"].split(" ")[0], "auto")]["placement"]
