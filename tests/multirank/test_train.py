"""Training on 2 ranks: the loss falls, and save + resume continues exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moeflow.config import ModelConfig, TrainConfig
from moeflow.launch import launch_local
from moeflow.topology import Topology
from moeflow.trainer import Trainer, lr_at

MICRO = ModelConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2, d_ff=64, moe_every=1,
                    moe=dict(num_experts=4, d_expert=32, top_k=2))


def _params(trainer: Trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _train_and_resume(root: str) -> dict:
    topo = Topology.from_env()
    cfg = TrainConfig(steps=8, batch_size=4, lr=1e-2, warmup_steps=2, eval_every=4,
                      eval_batches=2, log_every=1, checkpoint_every=4)
    full = Trainer(MICRO, cfg, f"{root}/full", topo, progress=False)
    full_result = full.run()
    # A second run in a new folder holding only the step-4 checkpoint of the first.
    if topo.rank == 0:
        shutil.copytree(f"{root}/full/checkpoint/step-4", f"{root}/resumed/checkpoint/step-4")
        shutil.copy(f"{root}/full/config.json", f"{root}/resumed/config.json")
        with open(f"{root}/resumed/checkpoint/latest", "w") as f:
            f.write("step-4")
    torch.distributed.barrier()
    resumed = Trainer(MICRO, cfg, f"{root}/resumed", topo, progress=False)
    resumed_result = resumed.run(resume=True)
    return {"full": full_result["history"], "resumed": resumed_result["history"],
            "full_params": _params(full), "resumed_params": _params(resumed)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return root, launch_local(_train_and_resume, 2, str(root), timeout_s=120)


@pytest.mark.multirank
def test_two_rank_training_learns_and_resumes_exactly(trained):
    tmp_path, out = trained
    full, resumed = out[0]["full"], out[0]["resumed"]
    assert full[0]["val_loss"] > 5.0                        # ~ln 256 at the start
    assert full[-1]["loss"] < full[1]["loss"] - 0.5         # it learns
    assert full[-1]["val_loss"] < full[0]["val_loss"] - 0.5
    after = {r["step"]: r for r in full if r["step"] > 4}
    assert [r["step"] for r in resumed] == sorted(after)
    for r in resumed:                                       # identical continuation
        assert r["loss"] == after[r["step"]]["loss"]
    for rank in (0, 1):
        for name, p in out[rank]["full_params"].items():
            assert torch.equal(p, out[rank]["resumed_params"][name]), name
    lines = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 8
    # the resumed run's clock continues from the checkpoint's, and config.json says so
    at_save = json.loads((tmp_path / "full" / "checkpoint" / "step-4" / "progress.json")
                         .read_text())["elapsed_s"]
    assert at_save > 0 and resumed[0]["elapsed_s"] > at_save
    saved = json.loads((tmp_path / "resumed" / "config.json").read_text())
    assert saved["resumed_from_step"] == 4


@pytest.mark.multirank
def test_two_rank_checkpoint_loads_on_one_rank(trained):
    """Experts are stored by global id, so a 2-rank checkpoint restores a 1-rank model."""
    from moeflow import checkpoint
    from moeflow.models import GPT
    from moeflow.trainer import make_optimizer

    tmp_path, out = trained
    model = GPT(MICRO)
    opt = make_optimizer(model, TrainConfig())
    assert checkpoint.load(str(tmp_path / "full" / "checkpoint" / "step-8"), model, opt) == 8
    for name, p in model.named_parameters():
        shards = [out[r]["full_params"][name] for r in (0, 1)]
        expect = torch.cat(shards) if ".experts." in name else shards[0]
        assert torch.equal(p, expect), name
    state = checkpoint.checkpoint_state(model, opt, torch.tensor(0))
    assert "model/blocks.0.ffn.experts.w1/expert/3" in state
    assert float(state["optim/blocks.0.ffn.experts.w1/step"]) == 8


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)
    assert lr_at(100, cfg) == pytest.approx(0.1)
