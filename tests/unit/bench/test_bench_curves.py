"""``moeflow bench curves``: validation curves of train runs as a table, JSON and PNG."""

from __future__ import annotations

import json

import pytest

from moeflow.cli import main


def _run(folder, structure, vals):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model": {"structure": structure}}))
    lines = [{"step": 0, "val_loss": 5.5}] + [
        {"step": 10 * (i + 1), "loss": v, "elapsed_s": 2.0 * (i + 1), "val_loss": v}
        for i, v in enumerate(vals)]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")


def test_curves_table_json_and_plot(tmp_path, capsys):
    _run(tmp_path / "a", "fine_grained", [3.0, 2.5])
    _run(tmp_path / "b", "bigmac", [2.9, 2.4])
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    argv = ["bench", "curves", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(png)]
    except ImportError:
        png = None
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "bigmac val (s)" in table and "2.400 (     4)" in table
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["fine_grained", "bigmac"]
    assert runs[1]["points"][-1] == [20, 4.0, 2.4]
    if png is not None:
        assert png.stat().st_size > 1000
    with pytest.raises(SystemExit):
        main(["bench", "curves", str(tmp_path)])
    assert "no metrics.jsonl" in capsys.readouterr().err
