"""The Table V analog driver (benchmarks.parm.parm_train): variants and step times from metrics."""

from __future__ import annotations

import json

import pytest

from benchmarks.parm.parm_train import parse_variant, step_times


def test_variants_parse_with_the_baseline_as_default():
    assert parse_variant("mp1-esp1") == (1, 1, "baseline")
    assert parse_variant("mp2-esp2:s2") == (2, 2, "s2")
    with pytest.raises(SystemExit, match="mp<N>-esp<N>"):
        parse_variant("tp2")


def test_step_times_skip_the_warmup_and_records_without_a_clock(tmp_path):
    recs = [{"step": 0, "val_loss": 5.0}] + [
        {"step": s, "elapsed_s": t} for s, t in ((1, 2.0), (2, 2.5), (3, 2.75), (5, 3.75))]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    assert step_times(path, 1) == [0.5, 0.25, 0.5]
    assert step_times(path, 3) == [0.5]
