"""``moeflow bench codecs`` runs end to end and writes its JSON."""

from __future__ import annotations

import json

from moeflow.cli import main
from moeflow.comm.codecs import zfp


def test_bench_codecs_cli(tmp_path, capsys):
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--codecs", "fp16,int8,zfp", "--sizes", "64x32",
                 "--reps", "1", "--error-rows", "16", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "zfp" in text and "activations" in text
    res = json.loads(out.read_text())
    assert {r["codec"] for r in res["throughput"]} == {"fp16", "int8", "zfp"}
    zfp_err = [e for e in res["errors"] if e["codec"] == "zfp"]
    assert {e["data"] for e in zfp_err} == {"gaussian", "smooth", "activations"}
    assert all(e["rel_error"] == e["zfpy_rel_error"] for e in zfp_err)
    assert all(r["bits_per_value"] > 0 and r["encode_gbs"] > 0 for r in res["throughput"])


def test_bench_codecs_zfp_rate(tmp_path, capsys):
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--codecs", "zfp", "--sizes", "64x32", "--reps", "1",
                 "--error-rows", "16", "--zfp-rate", "12", "--out", str(out)]) == 0
    assert "zfp rate 12" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["zfp_rate"] == 12 and res["throughput"][0]["bits_per_value"] == 12


def test_bench_codecs_rejects_a_rate_below_one_block_header():
    import pytest
    with pytest.raises(SystemExit, match="--zfp-rate 2"):
        main(["bench", "codecs", "--codecs", "zfp", "--zfp-rate", "2"])


def test_bench_zfp_arrays_cli(tmp_path, capsys):
    out = tmp_path / "arrays.json"
    assert main(["bench", "zfp-arrays", "--shapes", "37,9x11,5x6x7", "--reps", "1",
                 "--warmup", "0", "--out", str(out)]) == 0
    assert "bytes+values" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [r["dims"] for r in res["results"]] == [1, 1, 2, 2, 3, 3]
    assert all(r["same_bytes"] and r["same_values"] for r in res["results"])
    assert all(r["encode_mbs"] > 0 and r["zfpy_decode_mbs"] > 0 for r in res["results"])
    assert [r["coder"] for r in res["results"]] == [zfp.backend("cpu", r["dims"])
                                                    for r in res["results"]]


def test_bench_zfp_arrays_rejects_bad_shapes():
    import pytest
    with pytest.raises(SystemExit, match="--shapes item '4x4x4x4'"):
        main(["bench", "zfp-arrays", "--shapes", "4x4x4x4"])
