"""``moeflow simulate train --measured RUN_DIR`` (moeflow/commands/simulate_measured.py): a `moeflow
train --out` folder's step times next to the prediction, and the refusal of a run that the
arguments do not describe, naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moeflow.config import TrainConfig, model_preset
from moeflow.commands.simulate_measured import step_times, summarize

SETS = ["moe.a2a=direct", "moe.schedule=sequential", "moe.pipeline_degree=1"]


def _run(folder, step_ms=(900.0, 500.0, 100.0, 120.0, 110.0), **train):
    """A run folder as `moeflow train --preset tiny --nproc 2 --log-every 1 --set ...` leaves
    it: config.json and one metrics record per step (step 1 a slow warm-up)."""
    folder.mkdir(exist_ok=True)
    mcfg = model_preset("tiny", moe=dict(a2a="direct", schedule="sequential", pipeline_degree=1))
    tcfg = TrainConfig(**{"steps": len(step_ms), "log_every": 1, "device": "cpu",
                          "dtype": "fp32", **train})
    (folder / "config.json").write_text(json.dumps(
        {"model": dataclasses.asdict(mcfg), "train": dataclasses.asdict(tcfg),
         "world_size": 2, "local_size": 2}))
    tokens = 2 * tcfg.batch_size * tcfg.grad_accum * mcfg.seq_len
    lines = [{"step": 0, "val_loss": 5.6}]
    lines += [{"step": i + 1, "loss": 5.0, "tokens_per_s": tokens / (ms / 1e3),
               "elapsed_s": 1.0} for i, ms in enumerate(step_ms)]
    lines.insert(3, {"event": "restart", "restart": 1})        # events are not steps
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def test_step_times_skip_the_warm_up_and_take_the_median():
    recs = [{"step": 0, "val_loss": 1.0}, {"step": 2, "tokens_per_s": 10.0},
            {"event": "checkpoint"}, {"step": 4, "tokens_per_s": 20.0},
            {"step": 6, "tokens_per_s": 40.0}]
    got = step_times(recs, 100, skip=2)           # the record of steps 1-2 is warm-up
    assert [(t["first_step"], t["last_step"], t["step_s"]) for t in got] == [
        (3, 4, 5.0), (5, 6, 2.5)]
    assert summarize(got) == {"n": 2, "median_s": 3.75, "min_s": 2.5, "max_s": 5.0,
                              "steps": [3, 6]}


def test_measured_twin_reads_the_run_and_refuses_another_run(tmp_path, capsys):
    from moeflow.cli import main

    run = _run(tmp_path / "run")
    out = tmp_path / "p.json"
    args = ["simulate", "train", "--preset", "tiny", "--nproc", "2", "--profile",
            "schemoe-32gpu", *sum((["--set", s] for s in SETS), [])]
    assert main([*args, "--measured", str(run), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    m = row["measured"]
    assert (m["n"], m["steps"], m["skip_steps"]) == (3, [3, 5], 2)
    assert m["median_s"] == pytest.approx(0.110) and m["min_s"] == pytest.approx(0.100)
    assert m["max_s"] == pytest.approx(0.120)
    assert row["predicted_over_measured"] == pytest.approx(row["step_s"] / 0.110)
    assert "predicted / measured" in capsys.readouterr().out
    # the metrics file names the same run; --skip-steps 0 keeps the warm-up
    assert main([*args, "--measured", str(run / "metrics.jsonl"), "--skip-steps", "0",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["measured"]["max_s"] == pytest.approx(0.9)
    for extra, field in ((["--batch-size", "8"], "TrainConfig.batch_size"),
                         (["--grad-accum", "2"], "TrainConfig.grad_accum"),
                         (["--recompute", "full"], "TrainConfig.recompute"),
                         (["--set", "moe.top_k=1"], "ModelConfig.moe.top_k"),
                         (["--nproc", "4", "--set", "moe.num_experts=8"], "world_size"),
                         (["--nodes", "2"], "local_size"),
                         (["--device", "cuda"], "TrainConfig.device")):
        with pytest.raises(SystemExit, match=field):
            main([*args, *extra, "--measured", str(run)])
    # a run with the auto-tuned exchange (train's default) is not the same config
    cfg = json.loads((run / "config.json").read_text())
    cfg["model"]["moe"]["a2a"] = "auto"
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="ModelConfig.moe.a2a differs: the run has 'auto'"):
        main([*args, "--measured", str(run)])
    # a run folder of the old flat model config: a clear error naming the move
    cfg["model"] = {"top_k": 2, "a2a": "direct"}
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="old flat form .MoE fields a2a, top_k beside 'moe'"):
        main([*args, "--measured", str(run)])
    bf16 = _run(tmp_path / "bf16", dtype="bf16")
    with pytest.raises(SystemExit, match="TrainConfig.dtype='bf16'"):
        main([*args, "--measured", str(bf16)])
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        main([*args, "--measured", str(tmp_path)])


def test_measured_twin_with_accumulation_and_recompute(tmp_path):
    from moeflow.cli import main

    run = _run(tmp_path, grad_accum=2, recompute="moe_act")
    out = tmp_path / "p.json"
    assert main(["simulate", "train", "--preset", "tiny", "--nproc", "2", "--profile",
                 "schemoe-32gpu", *sum((["--set", s] for s in SETS), []), "--grad-accum", "2",
                 "--recompute", "moe_act", "--measured", str(run), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    # tokens per step count both micro-batches, so the step times are the written ones
    assert row["measured"]["median_s"] == pytest.approx(0.110)
    assert row["spec"]["grad_accum"] == 2 and row["spec"]["recompute"] == "moe_act"
