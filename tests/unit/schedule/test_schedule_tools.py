"""Timelines (Chrome trace, Gantt PNG), the task profiler's fits, the chooser, bench schedule."""

from __future__ import annotations

import json

import pytest
import torch

import moeflow as mf
from moeflow.cli import main
from moeflow.schedule.chooser import choose, explain
from moeflow.schedule.executor import Timeline
from moeflow.schedule.profiler import fit_linear, fit_models, profile
from moeflow.schedule.trace import chrome_trace, gantt_png


def _layer(**kw):
    return mf.MoELayer(mf.MoEConfig(d_model=16, d_expert=32, num_experts=4, **kw))


def test_timeline_records_all_tasks_and_exports(tmp_path):
    layer = _layer(schedule="optsche", pipeline_degree=2)
    layer.timeline = Timeline()
    layer(torch.randn(12, 16)).sum().backward()
    recs = layer.timeline.records
    assert sorted(str(r.task) for r in recs if r.phase == "forward") == sorted(
        f"{k}^{i}" for i in (1, 2) for k in ("C1", "A1", "D1", "E", "C2", "A2", "D2"))
    assert {r.lane for r in recs if r.task.is_comm} == {"comm"}
    assert all(r.end >= r.start for r in recs)
    chrome_trace(recs, str(tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 28
    pytest.importorskip("matplotlib")
    gantt_png(recs, str(tmp_path / "g.png"), "test")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="empty"):
        chrome_trace([], str(tmp_path / "e.json"))


def test_linear_fit_recovers_a_line():
    m = fit_linear([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.0])
    assert (m.a, m.b, m.r2) == pytest.approx((1.0, 2.0, 1.0))
    assert m.predict(10) == pytest.approx(21.0)


def test_profile_fits_every_task_group():
    records, steps = profile(_layer(), torch.randn(64, 16), [1, 2], reps=2)
    models = fit_models(records)
    assert set(models) == {"A", "C", "D", "E_forward", "E_backward"}
    assert len(steps) == 4 and all(s > 0 for s in steps)
    sizes = {r.size for r in records if r.task.kind == "E" and r.phase == "forward"}
    assert len(sizes) >= 2                          # r = 1 and r = 2 give different sizes


def test_chooser_ranks_candidates():
    best, cands, fits = choose(lambda c, a: _layer(codec=c, a2a=a), torch.randn(64, 16),
                               ["none"], ["direct"], [1, 2], ["sequential", "optsche"], reps=2)
    assert len(cands) == 4 and best is cands[0]
    assert all(c.predicted_s > 0 for c in cands)
    assert cands == sorted(cands, key=lambda c: c.predicted_s)
    assert "predicted ms" in explain(cands)


def test_bench_schedule_cli(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["bench", "schedule", "--codec", "none", "--tokens", "32", "--d-model", "16",
                 "--d-expert", "16", "--reps", "2", "--warmup", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "naive" in text and "optsche r=2" in text
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["speedup"] == 1.0 and len(rows) == 5
    with pytest.raises(SystemExit):
        main(["bench", "schedule", "--codec", "nope"])


def test_bench_smile_refuses_one_node(capsys):
    with pytest.raises(SystemExit) as err:
        main(["bench", "smile"])
    assert err.value.code == 2 and "several nodes" in capsys.readouterr().err


def test_time_variants_reports_a2a_time():
    from moeflow.bench.schedule_bench import time_variants

    base = mf.MoEConfig(d_model=16, d_expert=16, num_experts=4, top_k=1)
    rows = time_variants(base, [("a", {}), ("b", dict(schedule="optsche", pipeline_degree=2))],
                         mf.Topology.single(), torch.randn(32, 16), warmup=1, reps=2)
    assert [r["variant"] for r in rows] == ["a", "b"]
    assert all(0 < r["a2a_ms"] < r["step_ms"] for r in rows)
