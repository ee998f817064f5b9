"""moeflow bench recompute's summary (benchmarks/training/recompute.py) without launching ranks: the
ratios over ``none`` are taken within each repetition, and the JSON is written from the CLI's
parsed arguments (which carry the command's handler)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.training import recompute


def test_ratios_over_none_per_repetition_and_json_from_the_cli_arguments(tmp_path,
                                                                         monkeypatch):
    # per (repetition, mode): both ranks' step times and peak memory added
    fake = {(0, "none"): (1.0, 100), (0, "full"): (1.5, 70), (0, "moe_act"): (1.0, 90),
            (1, "none"): (2.0, 110), (1, "full"): (2.0, 77), (1, "moe_act"): (3.0, 110)}
    order = iter(fake)

    def launch(_fn, nproc, *_a, **_k):
        step, peak = fake[next(order)]
        return {r: {"times": [step, step], "peak_added_bytes": peak} for r in range(nproc)}

    monkeypatch.setattr("moeflow.launch.launch_local", launch)
    out = tmp_path / "r.json"
    p = argparse.ArgumentParser()
    recompute.add_arguments(p)
    p.set_defaults(func=lambda args: 0)
    args = p.parse_args(["--repeats", "2", "--steps", "2", "--out", str(out)])
    summary = json.loads(out.read_text())["summary"] if recompute.run(args) else None
    full = summary["full"]
    assert (full["step_over_none_min"], full["step_over_none_median"],
            full["step_over_none_max"]) == (1.0, 1.25, 1.5)
    assert full["memory_over_none_median"] == pytest.approx(0.7)
    assert summary["moe_act"]["step_over_none_max"] == 1.5
    assert "func" not in json.loads(out.read_text())["args"]
