"""The tuner's output routing (one line per tuning on the screen, the detail and a record per
tuning in the run folder) and reading recorded choices back (moeflow.autotune.runlog)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from moeflow.autotune import TunedChoice, append_record, log, log_to_run_folder, \
    recorded_choices, tune
from moeflow.config import MoEConfig
from moeflow.errors import ConfigError
from moeflow.layer import MoELayer
from moeflow.topology import Topology


def _choice(a2a="pairwise", r=2) -> TunedChoice:
    return TunedChoice(a2a, "optsche", r, 1.0, 2.0, "Topology(world=2)", tune_s=0.5)


def test_one_rank_tuning_is_one_line_and_one_record(tmp_path):
    torch.manual_seed(0)
    cfg = MoEConfig(d_model=8, d_expert=16, num_experts=2, top_k=1, a2a="auto",
                    schedule="auto", pipeline_degree="auto", layer_id=3)
    layer = MoELayer(cfg, Topology.single())
    seen: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record)

    catch = Catch(logging.DEBUG)
    log.addHandler(catch)
    before = (list(log.handlers), log.level)
    try:
        with log_to_run_folder(tmp_path):
            tune(layer, torch.randn(6, 8), cfg)
        assert (log.handlers, log.level) == before        # the run folder's handlers removed
    finally:
        log.removeHandler(catch)
    assert [r.levelno for r in seen] == [logging.INFO]
    assert "6 tokens" in seen[0].getMessage() and "layer_id 3" in seen[0].getMessage()
    rec = json.loads((tmp_path / "autotune.jsonl").read_text())
    assert (rec["layer_id"], rec["tokens"], rec["source"]) == (3, 6, "measured")
    assert rec["choice"]["a2a"] == "direct"


def test_detail_goes_to_the_file_only(tmp_path, capsys):
    with log_to_run_folder(tmp_path):
        log.debug("autotune layer: screen 1/4 ...")
        log.info("autotune layer: chose ...")
    text = (tmp_path / "autotune.log").read_text()
    assert "screen 1/4" in text and "chose" in text
    assert not (tmp_path / "autotune.jsonl").exists()     # no record without a choice
    assert "screen" not in capsys.readouterr().err


def test_recorded_choices_keep_the_last_record_of_each_layer(tmp_path):
    append_record(tmp_path, 1, _choice("direct", 1), "measured")
    append_record(tmp_path, 3, _choice(), "measured")
    append_record(tmp_path, 1, _choice("pairwise", 4), "measured")     # a re-tuning
    got = recorded_choices(tmp_path)
    assert sorted(got) == [1, 3]
    assert (got[1].a2a, got[1].pipeline_degree) == ("pairwise", 4)
    assert got[3] == _choice()


def test_recorded_choices_errors_name_the_flag_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="--tuned-from .*no autotune.jsonl"):
        recorded_choices(tmp_path)
    (tmp_path / "autotune.jsonl").write_text("not json\n")
    with pytest.raises(ConfigError, match="line 1 of autotune.jsonl"):
        recorded_choices(tmp_path)
    (tmp_path / "autotune.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no tuning record"):
        recorded_choices(tmp_path)
