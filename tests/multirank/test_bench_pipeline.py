"""``moeflow bench pipeline`` end to end on 4 local gloo ranks (the CLI, one launch): EP 4
and PP 2 x EP 2 under 1F1B at one global batch, every sample recorded per rank, the
figures in range (a bubble share in [0, 1) beside 1F1B's (p - 1) / (m + p - 1), exposed
all-to-all time at most the total), the quota in force recorded, the table printed."""

from __future__ import annotations

import json

import pytest

from moeflow.cli import main


@pytest.mark.multirank
@pytest.mark.slow   # 15 s, a measurement command; tests/unit/bench/test_bench_pipeline.py guards its parts
def test_bench_pipeline_records_every_configuration(tmp_path, capsys):
    out = tmp_path / "pp.json"
    assert main(["bench", "pipeline", "--nproc", "4", "--configs", "ep,pp2:1f1b",
                 "--warmup", "0", "--reps", "2", "--global-batch", "8",
                 "--micro-batches", "2", "--out", str(out)]) == 0
    assert "pp2:1f1b" in capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert (rec["world"], rec["reps"], rec["cpu_per_rank"]) == (4, 2, None)
    assert rec["command"].startswith("moeflow") and len(rec["load_start"]) == 3
    ep, pp = rec["cases"]
    assert (ep["pp"], pp["pp"], pp["schedule"], pp["grad_accum"]) == (1, 2, "1f1b", 2)
    for case in (ep, pp):
        assert len(case["step_s"]) == 2 and len(case["samples_per_rank"]) == 4
        t = case["tokens_per_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
        for mem in case["memory_per_rank"]:
            assert mem["state_bytes"] > 0 and mem["step_peak_bytes"] > 0
        for a in case["a2a_per_rank"]:
            assert 0 < a["a2a_s"]["median"]
            assert a["a2a_exposed_s"]["max"] <= a["a2a_s"]["max"] + 1e-9
    b = pp["bubble"]
    assert b["theory"] == pytest.approx(1 / 3)          # (p - 1) / (m + p - 1), p = m = 2
    assert all(0 <= r["min"] <= r["max"] < 1 for r in b["measured_per_rank"])
    assert all(s["chunk_n"]["forward"] == 2 for r in pp["samples_per_rank"] for s in r)
    assert "bubble" not in ep
