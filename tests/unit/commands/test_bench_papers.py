"""``moeflow bench NAME`` for the paper benchmarks: found by path in the source checkout's
``benchmarks/`` folder (moeflow/commands/bench_papers.py), and a clear error without one."""

from __future__ import annotations

import pytest

from moeflow.cli import build_parser, main
from moeflow.commands import bench_papers

PAPER_BENCHES = {"hecate": "hecate", "spag": "hecate", "spag-overlap": "hecate",
                 "hecate-train": "hecate", "hecate-fit": "hecate", "hecate-model": "hecate",
                 "parm": "parm", "parm-train": "parm", "smile": "smile", "bigmac": "bigmac",
                 "group-limited": "deepseek_v3", "recompute": "training",
                 "dense-shard": "training", "router-load": "training"}


def _bench_names(parser) -> dict:
    bench = parser._subparsers._group_actions[0].choices["bench"]
    return bench._subparsers._group_actions[0].choices


def test_every_paper_folder_registers_its_subcommands():
    assert bench_papers.paper_folders() == ["bigmac", "deepseek_v3", "hecate", "parm", "smile",
                                            "training"]
    names = _bench_names(build_parser())
    for name, paper in PAPER_BENCHES.items():
        assert name in names, f"moeflow bench {name} is not registered"
        func = names[name].get_default("func")
        assert func.__module__.startswith(f"benchmarks.{paper}."), (name, func.__module__)


def test_the_harness_is_registered_by_the_package():
    names = _bench_names(build_parser())
    for name in ("layer", "a2a", "links", "compute", "codecs", "zfp-arrays", "curves",
                 "schedule"):
        assert names[name].get_default("func").__module__.startswith("moeflow.commands."), name


def test_outside_a_checkout_a_paper_bench_says_where_it_lives(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_papers, "CHECKOUT_ROOT", tmp_path)      # an installed copy
    names = _bench_names(build_parser())
    assert "hecate" not in list(names) and "layer" in list(names)
    with pytest.raises(SystemExit) as err:
        main(["bench", "hecate"])
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert "'hecate' is not a benchmark of the installed package" in msg
    assert "source checkout's benchmarks/ folder" in msg
    with pytest.raises(SystemExit, match="paper benchmark of the source checkout"):
        bench_papers.import_from_checkout("benchmarks.hecate.hecate")


def test_in_a_checkout_an_unknown_bench_is_argparse_s_error(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "hecatee"])
    msg = capsys.readouterr().err
    assert "invalid choice: 'hecatee'" in msg and "source checkout" not in msg
