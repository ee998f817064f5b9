"""``moeflow bench compute``: every kernel kind is timed and fitted, the fit predicts its own
points, and bad arguments are clear errors."""

from __future__ import annotations

import json

import pytest

from moeflow.bench import compute
from moeflow.cli import main

KINDS = {"gemm", "gemm_backward", "experts", "experts_backward", "attention",
         "attention_backward", "elementwise", "codec:fp16"}


def test_measure_fits_every_kind_from_its_shapes():
    res = compute.measure([16, 64, 256], d=32, h=64, experts=4, heads=4, codecs=["fp16"],
                          warmup=1, reps=2)
    assert res["schema"] == "moeflow.compute/1" and res["threads"] >= 1
    assert {f["kind"] for f in res["fits"]} == KINDS
    for fit in res["fits"]:
        works = [p[0] for p in fit["points"]]
        assert len(works) == 3 and all(t > 0 for _, t, _ in fit["points"])
        assert fit["unit"] == ("byte" if fit["kind"].startswith(("codec", "elem")) else "flop")
        assert fit["alpha_s"] >= 0 and fit["beta_s_per_unit"] >= 0
        # the fitted line passes through the points' range
        pred = [compute.predict(res, fit["kind"], w) for w in works]
        assert min(pred) >= 0 and max(pred) <= 10 * max(p[1] for p in fit["points"])
    gemm = next(f for f in res["fits"] if f["kind"] == "gemm")
    assert [p[0] for p in gemm["points"]] == [2 * m * 32 * 64 for m in (16, 64, 256)]
    with pytest.raises(KeyError, match="no fit for kind 'conv'"):
        compute.predict(res, "conv", 1)


def test_at_least_two_row_counts():
    with pytest.raises(ValueError, match="at least 2 positive row counts"):
        compute.measure([64], d=8, h=8)


def test_cli_writes_json_with_provenance(tmp_path, capsys):
    out = tmp_path / "compute.json"
    assert main(["bench", "compute", "--rows", "8,32", "--d-model", "16", "--d-expert", "32",
                 "--experts", "2", "--heads", "2", "--codecs", "", "--warmup", "0", "--reps",
                 "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"command", "date", "load", "commit"} <= set(res["run_meta"])
    assert "gemm" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--rows", "8,x"], "--rows '8,x' is invalid"),
    (["--codecs", "fp17"], "unknown codec 'fp17'"),
    (["--reps", "0"], "--reps 0 is invalid"),
])
def test_bad_arguments(argv, message):
    with pytest.raises(SystemExit) as err:
        main(["bench", "compute", *argv])
    assert message in str(err.value)
