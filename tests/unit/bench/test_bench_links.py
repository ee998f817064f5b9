"""Alpha-beta fits and their JSON (``moeflow.measure.linkmodel``), ``bench links`` and ``bench a2a``
on local ranks (the emulated-cluster runs are in test_cluster.py)."""

from __future__ import annotations

import json
import math

import pytest

from moeflow.bench import a2a, links
from moeflow.measure.linkmodel import SCHEMA, AlphaBeta, fit_alpha_beta, fit_record, load_fits, \
    save_fits
from moeflow.launch import launch_local
from tests.helpers import bench_helpers


def test_fit_recovers_exact_line_and_reports_quality():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    t = [50e-6 + 8e-9 * s for s in sizes]
    fit = fit_alpha_beta(sizes, t)
    assert fit.alpha == pytest.approx(50e-6, rel=1e-9)
    assert fit.beta == pytest.approx(8e-9, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.max_rel_err < 1e-9
    assert fit.predict(2e6) == pytest.approx(50e-6 + 16e-3)
    assert fit.bandwidth == pytest.approx(1.25e8)


def test_fit_keeps_coefficients_non_negative():
    # noise on a line: close to the truth
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    t = [100e-6 + 1e-8 * s for s in sizes]
    t[-1] *= 1.01
    fit = fit_alpha_beta(sizes, t)
    assert fit.beta == pytest.approx(1e-8, rel=0.02) and fit.r2 > 0.999
    # times that fall with size would need beta < 0: clamped to a pure latency
    fit = fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3])
    assert fit.beta == 0 and fit.alpha == pytest.approx(1.5e-3)
    # a token bucket's free burst makes alpha negative: clamped to alpha = 0
    fit = fit_alpha_beta([1e5, 1e6, 1e7], [1e-5, 6e-3, 78e-3])
    assert fit.alpha == 0 and fit.beta > 0
    with pytest.raises(ValueError, match="2 points"):
        fit_alpha_beta([1e3], [1e-3])


def test_fits_json_roundtrip_and_schema(tmp_path):
    rec = fit_record("inter", "all_to_all", 2, 2, [(1024, 1e-4), (1 << 20, 9e-3)])
    path = tmp_path / "links.json"
    save_fits(str(path), [rec], {"layout": {"nodes": 2, "ranks_per_node": 2, "world": 4}})
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["fits"][0]["points"][0] == [1024, 1e-4]
    fits = load_fits(str(path))
    ab = fits[("inter", "all_to_all")]
    assert isinstance(ab, AlphaBeta) and ab.group_size == 2
    assert ab.predict(1024) == pytest.approx(1e-4, rel=1e-6)
    path.write_text(json.dumps({"schema": "other", "fits": []}))
    with pytest.raises(ValueError, match="schema"):
        load_fits(str(path))


def test_parse_sizes():
    assert links.parse_sizes("4K, 1M,4k") == [4096, 1 << 20]
    assert links.parse_sizes("512") == [512]
    with pytest.raises(ValueError, match="4K,64K"):
        links.parse_sizes("4Q")


def test_bounds_and_size_classes():
    assert [a2a.size_class(s) for s in (1024, 1 << 20, 199 << 20, 200 << 20)] == \
        ["small", "medium", "medium", "large"]
    data = {"layout": {"nodes": 2, "ranks_per_node": 2, "world": 4},
            "results": [{"algorithm": "direct", "class": "medium", "bytes": 8_000_000,
                         "median_s": 0.2}], "skipped": {}}
    a2a.add_bounds(data, {"inter": (1e9, "x"), "intra": (None, "unknown")})
    r = data["results"][0]
    # each node pushes 2 ranks * 8 MB * 2/4 = 8 MB through 125 MB/s: 64 ms
    assert r["bound_s"] == pytest.approx(0.064) and r["ratio"] == pytest.approx(0.2 / 0.064)
    data["layout"] = {"nodes": 1, "ranks_per_node": 4, "world": 4}
    a2a.add_bounds(data, {"inter": (None, "unknown"), "intra": (None, "unknown")})
    assert data["results"][0]["ratio"] is None and "n/a" in a2a.format_table(data)


def test_eq18_bound_and_pipe_summary(tmp_path):
    # ScheMoE Eq. 18: equal intra and inter work overlaps fully (2x); one side dominating -> ~1
    assert a2a.eq18_speedup(2, 4, 1.0, 1.0) == pytest.approx(2.0)
    assert a2a.eq18_speedup(2, 8, 1.0, 1.0) == pytest.approx(8 / 6)
    assert a2a.eq18_speedup(2, 4, 0.1, 1.0) == pytest.approx(2.2 / 2.0)
    with pytest.raises(ValueError, match="0 < m < p"):
        a2a.eq18_speedup(4, 4, 1.0, 1.0)
    data = {"layout": {"nodes": 2, "ranks_per_node": 2, "world": 4}, "skipped": {},
            "results": [{"algorithm": "pairwise", "class": "medium", "bytes": 4_000_000,
                         "median_s": 0.3},
                        {"algorithm": "pipe", "class": "medium", "bytes": 4_000_000,
                         "median_s": 0.2}]}
    # rates: block 1 MB, t1 = 1 ms at 8 Gbit/s, t2 = 8 ms at 1 Gbit/s -> (2 + 16) / 16
    bws = {"inter": (1e9, "x"), "intra": (8e9, "y")}
    a2a.add_bounds(data, bws)
    a2a.add_pipe_summary(data, bws)
    row = data["pipe_vs_pairwise"]["rows"][0]
    assert row["speedup"] == pytest.approx(1.5)
    assert row["t1_s"] == pytest.approx(1e-3) and row["t2_s"] == pytest.approx(8e-3)
    assert row["eq18_bound"] == pytest.approx(18 / 16)
    assert "Eq. 18" in a2a.format_table(data)
    # a links file's p2p fits take precedence over the rates
    recs = [fit_record("intra", "p2p", 2, 2, [(1e5, 1e-4), (1e6, 1e-3)]),
            fit_record("inter", "p2p", 2, 2, [(1e5, 1e-4), (1e6, 1e-3)])]
    path = tmp_path / "links.json"
    save_fits(str(path), recs, {"layout": data["layout"]})
    a2a.add_pipe_summary(data, bws, str(path))
    assert data["pipe_vs_pairwise"]["rows"][0]["eq18_bound"] == pytest.approx(2.0)
    # one node: no summary
    data = {**data, "layout": {"nodes": 1, "ranks_per_node": 4, "world": 4}}
    data.pop("pipe_vs_pairwise")
    a2a.add_pipe_summary(data, bws)
    assert "pipe_vs_pairwise" not in data


@pytest.mark.multirank
def test_links_and_a2a_benches_on_two_local_ranks(tmp_path):
    sizes = [4096, 65536]
    res = launch_local(links.links_worker, 2, sizes, 0, 2, timeout_s=120)
    assert res[1] is None
    fits = res[0]["fits"]
    assert res[0]["layout"] == {"nodes": 1, "ranks_per_node": 2, "world": 2}
    assert [(f["group"], f["op"]) for f in fits] == [("intra", op) for op in links.OPS]
    for f in fits:
        assert len(f["points"]) == 2 and all(t > 0 for _, t in f["points"])
        assert f["alpha_s"] >= 0 and f["beta_s_per_byte"] >= 0 and math.isfinite(f["r2"])
    assert "all_to_all" in links.format_table(fits)

    out = launch_local(bench_helpers.a2a_with_refusing, 2, [1024, 1 << 20], 0, 2,
                       timeout_s=120)[0]
    assert "needs 64 nodes" in out["skipped"]["test-needs-many-nodes"]
    rows = [r for r in out["results"] if r["algorithm"] == "direct"]
    assert [r["class"] for r in rows] == ["small", "medium"]
    assert rows[1]["bytes"] == 1 << 20
    a2a.add_bounds(out, {"inter": (None, "unknown"), "intra": (8e9, "--intra-bw")})
    assert all(r["ratio"] > 0 for r in out["results"])
    table = a2a.format_table(out)
    assert "skipped test-needs-many-nodes" in table
    pytest.importorskip("matplotlib")
    a2a.plot(out, str(tmp_path / "a2a.png"))
    assert (tmp_path / "a2a.png").stat().st_size > 1000
