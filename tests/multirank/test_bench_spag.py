"""``moeflow bench spag`` (spAG / spRS per transport, interleaved) and ``moeflow bench
spag-overlap`` (the early spAG against the attention forward; ``--backward``: the spRS on
the lane against the attention backward; ``--regather``: HECATE-RM's re-gather on the lane
under the next block's attention backward) on 4 ranks: every row present,
spreads ordered, the overlap figures in range, the tables print."""

from __future__ import annotations

import math

import pytest

from benchmarks.hecate import spag, spag_overlap
from moeflow.launch import launch_local
from tests.helpers import spag_bench_worker as sw


pytestmark = pytest.mark.slow      # a measurement command; the default run guards its library parts elsewhere


@pytest.fixture(scope="module")
def results():
    return launch_local(sw.worker, 4, timeout_s=120)


@pytest.mark.multirank
def test_transports_side_by_side(results):
    res = results[0]["spag"]
    rows = {(r["op"], r["variant"]): r for r in res["rows"]}
    assert sorted(rows) == [("spAG", "broadcast"), ("spAG", "p2p"), ("spRS", "broadcast"),
                            ("spRS", "p2p")]
    for r in rows.values():
        assert 0 < r["min_ms"] <= r["ms"] <= r["max_ms"] and len(r["samples_ms"]) == 2
        assert r["bytes_moved"] > 0
    assert rows["spAG", "p2p"]["p2p_over_this"] == 1.0
    assert res["groups_created"] >= 1            # the broadcast transport made its groups
    assert "spRS  broadcast" in spag.format_result(res)


@pytest.mark.multirank
def test_early_spag_overlap_rows(results):
    res = results[0]["overlap"]
    for transport in ("p2p", "broadcast"):
        rows = {r["variant"]: r for r in res["rows"] if r["transport"] == transport}
        assert sorted(rows) == ["attention", "early", "spag", "summary"]
        for v in spag_overlap.VARIANTS:
            assert 0 < rows[v]["min_ms"] <= rows[v]["ms"] <= rows[v]["max_ms"]
        s = rows["summary"]
        # timings on a loaded machine: a noisy repetition can give any value, even > 1
        assert math.isfinite(s["hidden"])
        assert s["hidden_paired_min"] <= s["hidden_paired_median"] <= s["hidden_paired_max"]
        assert all(0.0 <= f <= 1.0 for f in s["timeline_overlap_samples"])
        assert s["bytes_moved"] > 0
    assert "hidden by early issue" in spag_overlap.format_result(res)


@pytest.mark.multirank
def test_backward_overlap_rows(results):
    res = results[0]["backward"]
    rows = {r["variant"]: r for r in res["rows"]}
    assert sorted(rows) == ["overlapped", "spRS alone", "summary", "sync"]
    for v in ("sync", "overlapped", "spRS alone"):
        assert 0 < rows[v]["min_ms"] <= rows[v]["ms"] <= rows[v]["max_ms"]
    # only the overlapped block ran its spRS on the lane: warm-up 0 + 2 repetitions
    assert rows["summary"]["sprs_on_lane"] == {"sync": 0, "overlapped": 2}
    assert "sync / overlapped (paired)" in spag_overlap.format_result(res)


@pytest.mark.multirank
def test_regather_overlap_rows(results):
    res = results[0]["regather"]
    rows = {r["variant"]: r for r in res["rows"]}
    assert sorted(rows) == ["attention backward", "overlapped", "re-gather exposed, overlapped",
                            "re-gather exposed, sync", "spAG alone", "summary", "sync"]
    for v in ("sync", "overlapped", "spAG alone", "attention backward",
              "re-gather exposed, sync", "re-gather exposed, overlapped"):
        assert 0 < rows[v]["min_ms"] <= rows[v]["ms"] <= rows[v]["max_ms"]
        assert len(rows[v]["samples_ms"]) == 2
    s = rows["summary"]
    # only the overlapped model launched its re-gather on the lane: warm-up 0 + 2 repetitions
    assert s["regather_on_lane"] == {"sync": 0, "overlapped": 2}
    assert s["hidden_paired_min"] <= s["hidden_paired_median"] <= s["hidden_paired_max"] <= 1
    assert len(s["saved_over_spag_paired"]) == 2
    assert s["bytes_moved"] > 0 and len(res["loadavg_1min_start_end"]) == 2
    assert "re-gather hidden" in spag_overlap.format_result(res)
