"""`moeflow bench compute --out` with `{rank}`: one fit file per rank when run under a
launcher (`moeflow cluster run --cpu-per-rank X`), so each fit is taken under its rank's quota."""

import pytest

from moeflow.commands.bench_compute import out_path


def test_rank_placeholder_is_filled_from_launcher_rank():
    assert out_path("compute-w4-p{rank}.json", {"RANK": "3"}) == "compute-w4-p3.json"


def test_no_launcher_means_rank_zero_and_plain_names_are_kept():
    assert out_path("c-{rank}.json", {}) == "c-0.json"
    assert out_path("c.json", {"RANK": "2"}) == "c.json"


def test_bad_rank_is_refused():
    with pytest.raises(SystemExit, match="RANK"):
        out_path("c-{rank}.json", {"RANK": "x"})
