"""``moeflow bench parm``'s grid and summary (the timing itself runs under the cluster)."""

from __future__ import annotations

import pytest

from benchmarks.parm.parm import format_result, layouts, parse_layout, summarize
from moeflow.cli import main
from benchmarks.parm import commands as bench_parm


def test_layouts_fit_the_world():
    assert layouts(4, 2) == [(1, 2, 2), (2, 2, 1), (2, 1, 2)]
    assert layouts(8, 4) == [(1, 4, 2), (2, 4, 1), (2, 2, 2)]
    assert layouts(4, 1) == []                  # no MP or ESP group fits a node of one


def test_parse_layout():
    assert parse_layout("4x2x1") == (4, 2, 1, True)
    assert parse_layout("4x2x2:esp-in-node") == (4, 2, 2, True)
    assert parse_layout("1x2x4:ep-in-node") == (1, 2, 4, False)
    for bad in ("4x2", "4x0x1", "4x2x1:in-node", "a,b,c", "4x2x1x1"):
        with pytest.raises(ValueError, match=f"layout '{bad}': expected MPxEPxESP"):
            parse_layout(bad)


def test_layouts_flag_is_checked_before_any_rank(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("ranks were started")
    monkeypatch.setattr(bench_parm, "run_on_ranks", refuse)
    with pytest.raises(SystemExit, match="--layouts: layout '4x2'"):
        main(["bench", "parm", "--nproc", "8", "--layouts", "4x4x1,4x2"])
    with pytest.raises(SystemExit, match="--layouts and --compare deepspeed"):
        main(["bench", "parm", "--nproc", "8", "--layouts", "4x4x1", "--compare", "deepspeed"])
    # the auto layer's measured confirmation runs in its first step: never a timed one
    with pytest.raises(SystemExit, match="--warmup 0 must be >= 1: the auto layer times"):
        main(["bench", "parm", "--nproc", "4", "--warmup", "0"])


def _row(mp, esp, times, choice):
    return {"n_mp": mp, "n_ep": 2, "n_esp": esp, "tokens_per_rank": 8, "capacity_factor": 1.2,
            "step_ms": dict(zip(["baseline", "s1", "s2", "s2-aas", "auto"], times)),
            "auto_choice": choice, "predicted_comm_ms": {"s1": 1.0, "s2": 2.0}}


def test_summary_counts():
    rows = [_row(2, 1, [10, 5, 4, 6, 4], "s2"),        # S2 faster by 25 %: right
            _row(2, 1, [10, 5, 5.2, 6, 5], "s2"),      # within 10 %: not counted
            _row(1, 2, [10, 12, 8, 8, 12], "s1")]      # S1 loses to the baseline; wrong pick
    s = summarize(rows)
    assert s["cases"] == 3
    assert (s["s1_beats_baseline"], s["s2_beats_baseline"], s["s1_or_s2_beats_baseline"]) \
        == (2, 3, 3)
    assert (s["algorithm1_cases_differing_by_10pct"], s["algorithm1_picked_faster"]) == (2, 1)
    assert s["mean_speedup_over_baseline"]["N_MP=2,N_ESP=1"]["s2"] == pytest.approx(
        (10 / 4 + 10 / 5.2) / 2)
    assert s["saa_speedup_over_aas_mean"] == pytest.approx((6 / 4 + 6 / 5.2 + 8 / 8) / 3)
    text = format_result({"topology": "T", "rows": rows, "summary": s})
    assert "Algorithm 1 picked the faster in 1/2" in text
    rows[2]["esp_in_node"] = False                     # an EP-in-node row is marked "e"
    assert "1,2,2e" in format_result({"topology": "T", "rows": rows, "summary": s})


def test_accuracy_per_fit_set_and_n_mp():
    """Both fit sets' choices are scored; N_MP = 1 (S1 = S2 by the equations) apart."""
    rows = [_row(2, 1, [10, 5, 4, 6, 4], "s2"),        # S2 faster by 25 %
            _row(1, 2, [10, 12, 8, 8, 12], "s1"),      # N_MP = 1, S2 faster by 50 %
            _row(2, 2, [10, 5, 5.2, 6, 5], "s1")]      # within 10 %: not counted
    for r, (grid, default) in zip(rows, [("s2", "s1"), ("s1", "s1"), ("s1", "s2")]):
        r["algorithm1"] = {"grid": {"choice": grid}, "default": {"choice": default}}
    acc = summarize(rows)["algorithm1_accuracy"]
    assert acc["grid"] == {"all": [1, 2], "n_mp=1": [0, 1], "n_mp>1": [1, 1]}
    assert acc["default"] == {"all": [0, 2], "n_mp=1": [0, 1], "n_mp>1": [0, 1]}
    assert not any(k.startswith("comm_chain:") for k in acc)     # no --collectives rows
    text = format_result({"topology": "T", "rows": rows, "summary": summarize(rows)})
    assert "with the grid fits: picked the faster in 1/2, 1/1 (N_MP>1), 0/1 (N_MP=1)" in text
    # with --collectives: also scored against the S1 / S2 forward comm chains alone
    rows[0]["collectives"] = {"s1": {"chain_ms": 3.0}, "s2": {"chain_ms": 2.0}}   # S2 faster
    rows[2]["collectives"] = {"s1": {"chain_ms": 2.0}, "s2": {"chain_ms": 2.1}}   # within 10 %
    acc = summarize(rows)["algorithm1_accuracy"]
    assert acc["comm_chain:grid"]["all"] == [1, 1] and acc["comm_chain:default"]["all"] == [0, 1]


def test_summary_scores_the_three_way_choice_where_ted_ran():
    """Rows with a ted column: its speedup, and Algorithm 1 scored among S1, S2 and ted where
    the fastest leads the next by more than 10 %; rows without one (older results) are not."""
    rows = [_row(2, 2, [10, 5, 6, 6, 4], "ted"), _row(2, 2, [10, 5, 6, 6, 5], "s1"),
            _row(2, 2, [10, 5, 6, 6, 5], "s2")]
    rows[0]["step_ms"]["ted"] = 4.0          # fastest by 25 %: right
    rows[1]["step_ms"]["ted"] = 5.2          # within 10 % of S1: not counted
    s = summarize(rows)
    assert s["ted_beats_baseline"] == 2
    assert (s["algorithm1_three_way_cases_differing_by_10pct"],
            s["algorithm1_three_way_picked_fastest"]) == (1, 1)
    assert s["mean_speedup_over_baseline"]["N_MP=2,N_ESP=2"]["ted"] == pytest.approx(
        (10 / 4 + 10 / 5.2) / 2)


def test_summary_scores_the_pipelined_ted_as_a_candidate_where_it_ran():
    """Rows with a ``ted-r4`` column: auto's choice of it is scored among S1, S2, ted and
    ted-r4; a choice without a column (``ted-r2``) cannot be scored and is not."""
    rows = [_row(2, 2, [10, 5, 6, 6, 4], "ted-r4"), _row(2, 2, [10, 5, 6, 6, 4], "ted-r2")]
    for r in rows:
        r["step_ms"].update({"ted": 4.8, "ted-r4": 4.0})       # ted-r4 fastest by 20 %
    s = summarize(rows)
    assert (s["algorithm1_three_way_cases_differing_by_10pct"],
            s["algorithm1_three_way_picked_fastest"]) == (1, 1)
    text = format_result({"topology": "T", "rows": rows, "summary": s})
    assert "ted-r4" in text.splitlines()[1]                    # the column's header


def test_capacity_padding_reaches_the_ranks_and_defaults_to_the_config(monkeypatch):
    """``--capacity-padding``: passed to the ranks' opts; absent, None (the config's default);
    a bad value is refused by argparse before any rank."""
    got = []
    monkeypatch.setattr(bench_parm, "run_on_ranks", lambda fn, args, opts: got.append(opts))
    monkeypatch.setattr(bench_parm, "report", lambda *a: 0)
    main(["bench", "parm", "--nproc", "4", "--capacity-padding", "trim"])
    main(["bench", "parm", "--nproc", "4"])
    assert [o["capacity_padding"] for o in got] == ["trim", None]
    with pytest.raises(SystemExit):
        main(["bench", "parm", "--nproc", "4", "--capacity-padding", "none"])


def test_format_prints_the_padding_of_new_and_old_results():
    rows = [_row(2, 1, [10, 5, 4, 6, 4], "s2")]
    s = summarize(rows)
    old = format_result({"topology": "T", "rows": rows, "summary": s})
    assert "capacity_padding=- (Parm padded)" in old.splitlines()[0]
    rows[0].update(capacity_padding="trim", trimmed={"s1": True, "s2": False})
    new = format_result({"topology": "T", "capacity_padding": "trim", "rows": rows,
                         "summary": s})
    assert "capacity_padding=trim  trimmed: s1" in new.splitlines()[0]


def test_parm_paired_reads_old_and_new_results(tmp_path, capsys):
    """docs/benchmarks/scripts/parm_paired.py prints the padding of files with it and of
    files from before it."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "docs/benchmarks/scripts/parm_paired.py"
    spec = importlib.util.spec_from_file_location("parm_paired", script)
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)
    row = _row(2, 1, [10, 5, 4, 6, 4], "s2")
    row.update(top_k=2, samples_ms={v: [t, t] for v, t in row["step_ms"].items()})
    old = {"topology": "T", "rows": [row]}
    new = {"topology": "T", "capacity_padding": "trim",
           "rows": [dict(row, trimmed={"s1": True, "s2": False})]}
    paths = []
    for name, res in (("old", old), ("new", new)):
        paths.append(str(tmp_path / f"{name}.json"))
        Path(paths[-1]).write_text(json.dumps(res))
    paired.main(paths)
    out = capsys.readouterr().out
    assert "T  capacity_padding=- (Parm padded)" in out
    assert "T  capacity_padding=trim, trimmed: s1" in out


def test_parm_paired_scores_the_choice_against_every_timed_candidate():
    """Algorithm 1's choice: right when faster than every other timed candidate in every
    round, wrong when another one was faster in every round, a tie otherwise; a choice that
    was not timed as a column is not scored."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "docs/benchmarks/scripts/parm_paired.py"
    spec = importlib.util.spec_from_file_location("parm_paired", script)
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)
    s = {"s1": [10, 11, 12], "s2": [20, 21, 22], "ted": [9, 12, 13], "ted-r4": [5, 6, 7]}
    score = paired.score_choice
    assert score({"samples_ms": s, "auto_choice": "ted-r4"}) == "right"
    assert score({"samples_ms": s, "auto_choice": "s2"}) == "wrong (s1, ted, ted-r4 faster)"
    assert score({"samples_ms": s, "auto_choice": "s1"}) == "wrong (ted-r4 faster)"
    tie = {"s1": [10, 11, 12], "ted": [9, 12, 13]}           # ted faster in 1 of 3 rounds
    assert score({"samples_ms": tie, "auto_choice": "s1"}) == "tie"
    assert score({"samples_ms": s, "auto_choice": "ted-r2"}) is None
    # the measured auto's choice, scored the same way; rows from before it: not scored
    assert score({"samples_ms": s, "auto_confirmed": "ted-r4"}, "auto_confirmed") == "right"
    assert score({"samples_ms": s, "auto_choice": "s1"}, "auto_confirmed") is None


def test_parm_paired_prints_both_choices(tmp_path, capsys):
    """A --compare deepspeed row with the measured confirmation: Algorithm 1's choice and the
    one auto ran, each scored, and both tallies."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "docs/benchmarks/scripts/parm_paired.py"
    spec = importlib.util.spec_from_file_location("parm_paired", script)
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)
    s = {"deepspeed": [20, 20], "s1": [10, 11], "s2": [20, 21], "ted": [9, 12],
         "ted-r4": [5, 6], "auto": [5, 6]}
    res = {"topology": "T", "deepspeed_version": "0.19.8", "deepspeed_labels": ["deepspeed"],
           "rows": [{"tokens_per_rank": 512, "capacity_factor": 1.25, "samples_ms": s,
                     "auto_choice": "s1", "auto_confirmed": "ted-r4",
                     "auto_measured_ms": {"s1": 10.0, "ted-r4": 5.0}, "auto_confirm_s": 0.4,
                     "auto_confirm_cut": ["s2"]}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    paired.main([str(path)])
    out = capsys.readouterr().out
    assert "| s1 | wrong (ted-r4 faster) | ted-r4 (measured ms: s1 10, ted-r4 5; not " \
           "measured: s2; 0.4 s) | right |" in out
    assert "Algorithm 1 against every timed candidate: 0 right, 1 wrong" in out
    assert "auto (measured) against every timed candidate: 1 right, 0 wrong" in out


def test_rows_record_the_auto_layers_own_choices():
    """The auto variant's ``choice_record`` (through ``time_variants``) reaches the row: the
    measured choice beside Algorithm 1's; a layout without the auto parts records none."""
    from benchmarks.parm.parm import auto_record

    rec = {"auto_algorithm1": "s1", "auto_confirmed": "ted", "auto_confirm_cut": [],
           "auto_measured_ms": {"s1": 2.0, "ted": 1.0}, "auto_confirm_s": 0.1}
    got = [{"variant": "s1", "step_ms": 1.0}, {"variant": "auto", "step_ms": 1.0, **rec}]
    assert auto_record(got) == rec
    assert auto_record(got[:1]) == {}
    row = dict(_row(2, 1, [10, 5, 4, 6, 4], "s1"), auto_confirmed="ted")
    text = format_result({"topology": "T", "rows": [row], "summary": summarize([row])})
    assert text.splitlines()[3].split()[-4:-2] == ["s1", "ted"]
