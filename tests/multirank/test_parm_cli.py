"""``moeflow train --mp N --esp N``: layout errors before any rank starts, a short run on 4 gloo
ranks that resumes on another layout. (That the trainer feeds an MP group one batch is tested
in tests/multirank/test_gpt_tp.py, on ranks it starts anyway.)"""

from __future__ import annotations

import json

import pytest

from moeflow.cli import main

SMALL = ["--set", "n_layers=2", "--set", "seq_len=16", "--set", "d_model=32", "--set",
         "n_heads=2", "--set", "d_ff=64", "--set", "moe.num_experts=4", "--set", "moe.d_expert=32"]


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "4", "--mp", "3"], "--mp 3 is invalid with 4 ranks"),
    (["--nproc", "4", "--mp", "0"], "--mp: TrainConfig.mp_size=0 is invalid"),
    (["--nproc", "4", "--mp", "2", "--set", "n_heads=1"],
     "ModelConfig.n_heads=1 is invalid with mp_size=2"),
    (["--nproc", "4", "--esp", "2", "--set", "moe.d_expert=33"],
     "--esp 2 is invalid with an expert hidden width of 33"),
    (["--nproc", "4", "--esp", "2", "--ep-size", "4"], "ep_size=4 x esp_size=2 = 8 is invalid"),
    (["--nproc", "4", "--esp", "2", "--set", "moe.parallel_schedule=magic"],
     "MoEConfig.parallel_schedule='magic'"),
])
def test_bad_layouts_are_clear_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        main(["train", *SMALL, *argv])
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multirank
@pytest.mark.slow   # the default run: test_gpt_tp (MP x EP training), test_checkpoint_layouts (resume across layouts)
def test_train_with_mp_and_esp_then_resume_without(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["train", *SMALL, "--batch-size", "2", "--eval-batches", "1", "--warmup-steps",
              "0", "--log-every", "1", "--out", str(out), "--no-progress"]
    assert main([*common, "--nproc", "4", "--steps", "2", "--eval-every", "2", "--mp", "2",
                 "--esp", "2", "--set", "moe.parallel_schedule=baseline"]) == 0
    assert "validation loss" in capsys.readouterr().out
    records = _records(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["loss"] == r["loss"] for r in records[1:])          # finite, logged
    train = json.loads((out / "config.json").read_text())["train"]
    assert (train["mp_size"], train["esp_size"], train["esp_in_node"]) == (2, 2, True)
    # the checkpoint (MP=2, ESP=2) resumes with pure expert parallelism over 2 ranks
    assert main([*common, "--nproc", "2", "--steps", "3", "--eval-every", "3", "--set",
                 "moe.parallel_schedule=baseline", "--resume"]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    assert [r["step"] for r in _records(out)][-1] == 3


def test_runs_saved_before_a_model_field_existed_resume(tmp_path):
    """config.json of an older run lacks moe.parallel_schedule: it counts as the default."""
    import dataclasses

    from moeflow.config import ConfigError, ModelConfig
    from moeflow.trainer import check_same_model

    saved = dataclasses.asdict(ModelConfig())
    del saved["moe"]["parallel_schedule"]
    (tmp_path / "config.json").write_text(json.dumps({"model": saved}))
    check_same_model(tmp_path, ModelConfig())
    with pytest.raises(ConfigError, match=r"'moe.top_k': \(2, 1\)"):
        check_same_model(tmp_path, ModelConfig(moe=dict(top_k=1)))
