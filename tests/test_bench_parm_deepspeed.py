"""``moeflow bench parm --compare deepspeed`` without DeepSpeed: the skip, the argument checks.

The comparison itself needs deepspeed (an optional peer, not a dependency) and 4 ranks; it is
run by hand (docs/benchmarks/parm.md, "Against DeepSpeed-MoE"), not in CI."""

from __future__ import annotations

import pytest

from moeflow.bench import parm_deepspeed as pd
from moeflow.cli import main
from moeflow.commands import bench_parm

SMALL = ["bench", "parm", "--compare", "deepspeed", "--nproc", "4", "--tokens", "64",
         "--d-model", "32", "--reps", "1"]


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any rank would be started."""
    def refuse(*a, **k):
        raise AssertionError("ranks were started")
    monkeypatch.setattr(bench_parm, "run_on_ranks", refuse)


def test_skips_with_a_message_when_deepspeed_is_absent(monkeypatch, capsys, no_ranks):
    monkeypatch.setattr(pd, "deepspeed_available", lambda: False)
    assert main([*SMALL, "--capacity-factors", "1.25"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == pd.SKIP_MESSAGE
    assert "Against DeepSpeed-MoE" in out and "not importable" in out


def test_availability_follows_the_import_system(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert pd.deepspeed_available() is False
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert pd.deepspeed_available() is True


@pytest.mark.parametrize("argv,message", [
    # ceil(2 * 1.2 * 64 / 4) = 39: DeepSpeed cannot split it over N_MP = 2
    (["--capacity-factors", "1.2"], "--tokens 64 with capacity factor 1.2"),
    (["--capacity-factors", "1.25", "--top-k", "3"], "--top-k 3 must be 1 or 2"),
])
def test_bad_arguments_are_clear_errors_before_any_rank(monkeypatch, no_ranks, argv, message):
    monkeypatch.setattr(pd, "deepspeed_available", lambda: False)   # checked before the skip
    with pytest.raises(SystemExit) as err:
        main([*SMALL, *argv])
    assert message in str(err.value.code)


def test_unknown_peer_is_rejected(capsys):
    with pytest.raises(SystemExit) as err:
        main([*SMALL, "--compare", "tutel"])
    assert err.value.code == 2
    assert "invalid choice: 'tutel'" in capsys.readouterr().err


@pytest.mark.parametrize("tokens,k,E,f,ok", [(512, 2, 4, 1.25, True), (512, 2, 4, 2.4, False),
                                             (2048, 2, 4, 1.2, False), (64, 2, 4, 2.0, True)])
def test_capacity_divides(tokens, k, E, f, ok):
    assert pd.capacity_divides(tokens, k, E, f, 2) is ok
