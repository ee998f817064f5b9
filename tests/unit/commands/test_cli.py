"""The ``moeflow`` command line: argument errors, a short training run, the layer benchmark."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys

import pytest

from moeflow.cli import main
from moeflow.commands.common import parse_overrides


def test_overrides_none_depends_on_the_field():
    from moeflow.config import ModelConfig

    assert parse_overrides(["moe.codec=none", "moe.capacity_factor=none", "dropout=0.5"],
                           ModelConfig) == {"moe": {"codec": "none", "capacity_factor": None},
                                            "dropout": 0.5}


def test_overrides_parse_types():
    assert parse_overrides(["top_k=1", "capacity_factor=none", "lr=0.5", "router=topk"]) == {
        "top_k": 1, "capacity_factor": None, "lr": 0.5, "router": "topk"}


def test_overrides_reach_every_moe_config_field():
    from moeflow.config import ModelConfig, model_preset
    from moeflow.models.gpt import GPT

    sets = ["moe.capacity_padding=pad", "moe.gate_noise=0.5", "moe.renormalize=none",
            "moe.top_k=1"]
    overrides = parse_overrides(sets, ModelConfig)
    assert overrides == {"moe": {"capacity_padding": "pad", "gate_noise": 0.5,
                                 "renormalize": None, "top_k": 1}}
    model = GPT(model_preset("tiny", n_layers=2, **overrides))
    layers = [m for m in model.modules() if type(m).__name__ == "MoELayer"]
    assert layers and all(
        (m.cfg.capacity_padding, m.cfg.gate_noise, m.cfg.renormalize, m.cfg.top_k)
        == ("pad", 0.5, None, 1) for m in layers)


@pytest.mark.parametrize("argv,message", [
    (["train", "--set", "moe.capacity_paddin=pad"], "did you mean 'capacity_padding'"),
    (["train", "--set", "moe.capacity_padding=wide"], "MoEConfig.capacity_padding='wide'"),
    (["train", "--set", "moe.layer_id=3"], "ModelConfig.moe.layer_id=3"),
    (["train", "--set", "moe.d_model=64"], "must equal ModelConfig.d_model=128"),
    (["train", "--set", "oops"], "FIELD=VALUE"),
    (["train", "--set", "moe.top_k=99"], "MoEConfig.top_k=99"),
    (["train", "--set", "colour=red"], "'colour' is not a field of ModelConfig"),
    # the one spelling: a MoE field given flat names moe.FIELD
    (["train", "--set", "top_k=1"], "top_k is a field of ModelConfig.moe: write --set "
                                    "moe.top_k=1"),
    (["train", "--set", "moe=1"], "--set moe.FIELD=VALUE"),
    (["train", "--set", "mo.top_k=1"], "did you mean 'moe'?"),
    (["train", "--steps", "0"], "TrainConfig.steps=0"),
    (["train", "--nproc", "0"], "--nproc 0"),
    (["train", "--data", "/no/such/place"], "no such file"),
    (["train", "--set", "topk=1"], "did you mean 'moe.top_k'?"),
    (["train", "--set", "moe.topk=1"], "did you mean 'top_k'?"),
    (["train", "--set", "moe.router=topkk"], "did you mean 'topk'?"),
    (["train", "--steps", "10", "--warmup-steps", "50"], "--warmup-steps: "),
    # checked before any rank starts (no launcher traceback)
    (["train", "--ep-size", "3"], "--ep-size 3 is invalid with 2 ranks"),
    (["train", "--set", "moe.num_experts=3"], "--set moe.num_experts=3 is invalid with an "
                                             "expert-parallel size of 2"),
    (["train", "--nproc", "1", "--set", "seq_len=100000"], "seq_len"),
])
def test_bad_arguments_are_clear_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.multirank
def test_train_cli_end_to_end(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "moeflow.cli", "train", "--steps", "3", "--batch-size", "2",
           "--eval-every", "3", "--eval-batches", "1", "--warmup-steps", "1", "--log-every", "1",
           "--set", "n_layers=2", "--set", "seq_len=32", "--out", str(out), "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "validation loss" in done.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3 and "val_loss" in records[-1]
    assert (out / "checkpoint" / "latest").read_text() == "step-3"
    again = subprocess.run(cmd[:5] + ["5"] + cmd[6:] + ["--resume"], capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-2:] == [4, 5]
    assert records[-2]["elapsed_s"] > records[-3]["elapsed_s"]     # the clock continues
    assert "done: 2 steps" in again.stdout and "resumed from step 3" in again.stdout
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 5
    for steps in ("5", "2"):                   # at or below the checkpoint: nothing to do
        idle = subprocess.run(cmd[:5] + [steps] + cmd[6:] + ["--resume"], capture_output=True,
                              text=True, timeout=300)
        assert idle.returncode == 0, idle.stderr[-3000:]
        assert "nothing to do" in idle.stdout and "step 5" in idle.stdout
        assert "--steps" in idle.stdout


def test_bench_layer_cli(tmp_path, capsys):
    out = tmp_path / "layer.json"
    assert main(["bench", "layer", "--tokens", "64", "--d-model", "16", "--d-expert", "32",
                 "--warmup", "1", "--reps", "2", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "gshard-top2-cap1.25" in table and "all_to_all" in table
    rows = json.loads(out.read_text())["results"]
    assert [r["name"] for r in rows] == ["switch-top1-cap1.25", "gshard-top2-cap1.25",
                                         "dropless-top2", "dropless-top2-loop",
                                         "dropless-top2-swiglu"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["phase_ms"]["experts"] > 0
        assert sum(r["phase_ms"].values()) <= r["step_ms"] * 1.05
        # the host-sync budget on CPU: one read, of the row counts (dropless) or of the kept
        # counts (capacity with capacity_padding="auto", which trims on CPU; padded capacity,
        # the GPU default, makes none: tests/multirank/test_host_sync.py)
        assert r["host_syncs"] == 1, r
        assert r["overlap"] is None                      # one rank: nothing to overlap


def test_bench_layer_cli_pipelined_rows_report_overlap(tmp_path, capsys):
    out = tmp_path / "layer.json"
    assert main(["bench", "layer", "--tokens", "64", "--d-model", "16", "--d-expert", "32",
                 "--warmup", "1", "--reps", "2", "--nproc", "2", "--schedules",
                 "sequential,optsche", "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    r = rows["gshard-top2-optsche-r2"]
    assert r["schedule"] == "optsche" and r["host_syncs"] == 1    # the kept counts (trim)
    assert 0.0 <= r["overlap"] <= 1.0
    with pytest.raises(SystemExit, match="did you mean 'optsche'"):
        main(["bench", "layer", "--schedules", "optshe"])


def test_bench_layer_cli_reports_inter_node_bytes(tmp_path, capsys):
    """2 emulated nodes x 1: every configuration sends some payload across; one node sends
    none; the hierarchical algorithm's rows are named after it."""
    out = tmp_path / "layer.json"
    assert main(["bench", "layer", "--tokens", "32", "--d-model", "8", "--d-expert", "16",
                 "--warmup", "1", "--reps", "1", "--nproc", "2", "--local-size", "1",
                 "--algorithms", "direct,hier2d", "--out", str(out)]) == 0
    assert "inter_bytes" in capsys.readouterr().out
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["dropless-top2@hier2d"]["a2a"] == "hier2d"
    assert all(r["inter_node_bytes"] > 0 for r in rows.values())
    # dropless top-2 over 8 experts: both algorithms move the same rows across nodes
    assert (rows["dropless-top2@direct"]["inter_node_bytes"]
            == rows["dropless-top2@hier2d"]["inter_node_bytes"])
    with pytest.raises(SystemExit, match="did you mean 'hier2d'"):
        main(["bench", "layer", "--algorithms", "hier2"])


def test_bench_layer_auto_rows_run_the_tuners_placement(tmp_path):
    """``--algorithms direct,auto`` on 2 emulated nodes x 1: the ``auto`` rows
    (placement="auto") record the strategy the tuner kept and both measured placements."""
    out = tmp_path / "layer.json"
    assert main(["bench", "layer", "--tokens", "16", "--d-model", "8", "--d-expert", "16",
                 "--warmup", "1", "--reps", "1", "--nproc", "2", "--local-size", "1",
                 "--algorithms", "direct,auto", "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    auto = rows["dropless-top2@auto"]
    assert auto["placement"] in ("ep", "node_dedup")
    assert auto["placement"] == auto["tuned"]["placement"]
    assert {m["placement"] for m in auto["tuned"]["candidates"]} == {"ep", "node_dedup"}
    assert rows["dropless-top2@direct"]["placement"] == "ep"
    assert rows["dropless-top2@direct"]["tuned"] is None


def test_train_steps_5_needs_no_other_flag():
    from moeflow.cli import build_parser
    from moeflow.commands.train_command import configs_from_args

    _, tcfg = configs_from_args(build_parser().parse_args(["train", "--steps", "5"]))
    assert (tcfg.steps, tcfg.warmup_steps) == (5, 0)


def test_train_tunes_the_placement_only_when_asked():
    from moeflow.cli import build_parser
    from moeflow.commands.train_command import configs_from_args

    plain, _ = configs_from_args(build_parser().parse_args(["train", "--steps", "5"]))
    assert plain.moe.placement == "ep" and plain.moe.a2a == "auto"
    auto, _ = configs_from_args(build_parser().parse_args(
        ["train", "--steps", "5", "--set", "moe.placement=auto"]))
    assert (auto.moe.placement, auto.moe.a2a, auto.moe.schedule) == ("auto", "auto", "auto")


def _walk(parser, path=("moeflow",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, path + (name,))


def test_every_option_has_help_and_shows_its_default():
    from moeflow.cli import build_parser

    bad, seen = [], 0
    for path, parser in _walk(build_parser()):
        parser.format_help()                        # every help string formats
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            seen += 1
            name = " ".join(path) + " " + ("/".join(action.option_strings) or action.dest)
            if not action.help or action.help == argparse.SUPPRESS:
                bad.append(f"{name}: no help")
            elif action.option_strings and action.required is False and \
                    "default" not in formatter._get_help_string(action).lower():
                bad.append(f"{name}: default not shown")
    assert seen > 100
    assert not bad, "\n".join(bad)


def test_data_and_resume_are_checked_before_the_ranks_start(tmp_path, capsys):
    from moeflow.cli import build_parser
    from moeflow.commands.train_command import configs_from_args

    (tmp_path / "empty").mkdir()
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    cases = [(["--data", str(tmp_path / "empty")], "no non-empty text files"),
             (["--resume", "--out", str(tmp_path / "none")], "no checkpoint under"),
             (["--resume", "--out", str(run), "--set", "moe.top_k=1"],
              "differs from the checkpoint's (field: (saved, now)) {'moe.top_k': (2, 1)}"),
             (["--resume", "--out", str(tmp_path / "flat"), "--set", "moe.top_k=1"],
              "the model config is in the old flat form (MoE fields top_k beside 'moe')")]
    saved, _ = configs_from_args(build_parser().parse_args(["train"]))     # the run's
    (run / "config.json").write_text(json.dumps({"model": dataclasses.asdict(saved)}))
    (run / "checkpoint" / "latest").write_text("step-3")
    shutil.copytree(run, tmp_path / "flat")
    (tmp_path / "flat" / "config.json").write_text(json.dumps({"model": {"top_k": 2}}))
    for argv, message in cases:
        with pytest.raises(SystemExit) as err:
            main(["train", *argv])
        assert err.value.code == 2
        assert message in capsys.readouterr().err


def test_skipped_binary_files_are_counted(tmp_path, capsys, monkeypatch):
    from moeflow.commands import train_command as train_cmd

    (tmp_path / "a.txt").write_text("hello world " * 500)
    (tmp_path / "b.txt").write_bytes(b"\x00\xff" * 100)
    monkeypatch.setattr(train_cmd, "run_on_ranks", lambda *a, **k: None)   # no ranks
    assert main(["train", "--data", str(tmp_path), "--out", str(tmp_path / "run")]) == 0
    assert "skipped 1 file that is not UTF-8 text" in capsys.readouterr().out


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()


@pytest.mark.multirank
def test_a_failing_rank_is_reported_once_with_the_traceback_in_the_run_folder(tmp_path, capfd):
    from moeflow.commands.common import RanksFailed, run_on_ranks

    args = argparse.Namespace(nproc=2, timeout=30.0)
    with pytest.raises(RanksFailed) as err:
        run_on_ranks(_fail_on_rank_one, args, log_dir=str(tmp_path))
    lines = str(err.value).splitlines()
    assert lines[-1] == "rank 1: ValueError: rank one is broken"
    assert str(tmp_path / "error.log") in lines[0]
    log = (tmp_path / "error.log").read_text()
    assert "Traceback" in log and "_fail_on_rank_one" in log and "rank one is broken" in log
    assert "Traceback" not in capfd.readouterr().err     # the console gets the short form


def test_bench_json_records_its_provenance(monkeypatch):
    from moeflow.commands.common import run_meta

    monkeypatch.setenv("MOEFLOW_CLUSTER_INTER_BPS", "1e9")
    monkeypatch.setattr(sys, "argv", ["moeflow", "bench", "layer", "--tokens", "8"])
    meta = run_meta()
    assert meta["command"] == "moeflow bench layer --tokens 8"
    assert meta["link"] == {"inter_bps": 1e9}
    assert len(meta["load"].split()) == 3 and meta["cpus"] >= 1
    # the commit of the checkout the package runs from (None for an installed copy)
    import moeflow
    from pathlib import Path

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(moeflow.__file__).parent).stdout.strip()
    assert meta["commit"] == (head or None)


def test_every_bench_starts_from_the_cli():
    """Benchmarks that own their options (parm-train, group-limited) start as `moeflow bench X`
    with the options of their module."""
    from benchmarks.deepseek_v3 import group_limited
    from benchmarks.parm import parm_train
    from moeflow.cli import build_parser

    args = build_parser().parse_args(["bench", "parm-train", "--variants", "mp1-esp1",
                                      "--out", "x.json"])
    assert args.variants == "mp1-esp1" and args.out == "x.json" and callable(args.func)
    args = build_parser().parse_args(["bench", "group-limited", "--top-k", "2"])
    assert args.top_k == 2 and args.func is group_limited.run
    assert parm_train.__name__ == "benchmarks.parm.parm_train"


def test_bench_spag_overlap_refuses_two_measurements():
    with pytest.raises(SystemExit, match="--backward and --regather are two different "
                                         "measurements"):
        main(["bench", "spag-overlap", "--backward", "--regather"])
