"""The trainer's fixed tuner choices in one process (``moeflow/trainer.py``, docs/training.md
"Reproducible runs"): ``--deterministic`` fixes the untuned defaults and stops re-tuning,
``--tuned-from`` restores a run folder's records and refuses records of another layout or
model, and the gradient norm is logged with the loss."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from moeflow.autotune import TunedChoice, append_record, layout, retune_agreed
from moeflow.config import ConfigError
from moeflow.topology import Topology
from moeflow.trainer import Trainer
from tests.helpers.fault_injection import MICRO_MODEL, MICRO_TRAIN

AUTO_MODEL = MICRO_MODEL.replace(moe=dict(a2a="auto", schedule="auto",
                                          pipeline_degree="auto"))


@pytest.fixture
def restore_torch_determinism(monkeypatch):
    """``--deterministic`` sets process-wide torch flags: put them back after the test."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              torch.backends.cudnn.deterministic)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[1:]


def _trainer(out, model=AUTO_MODEL, **train) -> Trainer:
    cfg = dataclasses.replace(MICRO_TRAIN, steps=2, checkpoint_every=0, **train)
    return Trainer(model, cfg, out, Topology.single(), progress=False)


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "autotune.jsonl").read_text().splitlines()]


def test_deterministic_fixes_the_defaults_and_never_retunes(tmp_path,
                                                             restore_torch_determinism):
    trainer = _trainer(tmp_path, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    result = trainer.run()
    layers = trainer.model.moe_layers()
    assert layers and all(m.retune_check_every is None for m in layers)
    assert not any(retune_agreed(m) for m in layers for _ in range(60))    # never re-tunes
    assert all((m.cfg.a2a, m.cfg.schedule, m.cfg.pipeline_degree) == ("direct", "sequential", 1)
               for m in layers)
    recs = _records(tmp_path)
    assert [r["source"] for r in recs] == ["fixed defaults"] * len(layers)
    assert all(r["choice"]["measured_ms"] is None for r in recs)       # nothing was measured
    norms = [r["grad_norm"] for r in result["history"] if "loss" in r]
    assert len(norms) == 2 and all(math.isfinite(n) and n > 0 for n in norms)


def test_tuned_from_restores_the_recorded_choice(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    topo = layout(Topology.single())
    for lid in AUTO_MODEL.moe_layer_ids():
        append_record(src, lid, TunedChoice("pairwise", "optsche", 2, None, 1.0, topo),
                      "measured")
    trainer = _trainer(tmp_path / "run", tuned_from=str(src))
    trainer.fix_tuned_choices()
    for m in trainer.model.moe_layers():
        assert (m.cfg.a2a, m.cfg.schedule, m.cfg.pipeline_degree) == ("pairwise", "optsche", 2)
        assert m.retune_check_every is not None         # not --deterministic: may re-tune


def test_tuned_from_refuses_another_layout_another_model_and_nothing_to_tune(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    ids = AUTO_MODEL.moe_layer_ids()
    append_record(src, ids[0], TunedChoice("direct", "sequential", 1, None, None,
                                           "Topology(world=8, nodes=2x4)"), "measured")
    with pytest.raises(ConfigError, match="tuned on Topology\\(world=8"):
        _trainer(tmp_path / "a", tuned_from=str(src)).fix_tuned_choices()
    (src / "autotune.jsonl").unlink()
    append_record(src, 99, TunedChoice("direct", "sequential", 1, None, None,
                                       layout(Topology.single())), "measured")
    with pytest.raises(ConfigError, match=f"layer_id {ids[0]} .*recorded: \\[99\\]"):
        _trainer(tmp_path / "b", tuned_from=str(src)).fix_tuned_choices()
    with pytest.raises(ConfigError, match="no MoE layer of this run is auto-tuned"):
        _trainer(tmp_path / "c", model=MICRO_MODEL, tuned_from=str(src)).fix_tuned_choices()
