"""Checkpoints by global identity across Parm layouts: (mp, ep, esp) = (2, 1, 2) -> (1, 2, 2)
-> one process, resuming exactly (parameters and AdamW state); other models are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moeflow import checkpoint
from moeflow.config import ConfigError
from moeflow.launch import launch_local
from moeflow.models import GPT
from tests.helpers import checkpoint_layout_cases as cases
from tests.helpers.gpt_tp_cases import global_slice

TOL = dict(rtol=1e-9, atol=1e-12)
WORLD = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return root, launch_local(cases.worker, WORLD, str(root), timeout_s=180), cases.reference()


def _assert_slices(got: dict, full: dict, locate: dict, label: str) -> None:
    for name, value in got.items():
        torch.testing.assert_close(value, global_slice(full[name], locate[name], name), **TOL,
                                   msg=lambda m: f"{name} {label}: {m}")


@pytest.mark.multirank
def test_resumes_on_another_layout_as_the_uninterrupted_run(run):
    _, results, ref = run
    for rank in range(WORLD):
        got = results[rank]
        assert got["loaded_step"] == cases.SAVE_AT
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-10)
        _assert_slices(got["resumed"], ref["at_save"], got["locate"], f"loaded on rank {rank}")
        _assert_slices(got["params"], ref["params"], got["locate"], f"after on rank {rank}")
        kinds = {w[0] for w in got["locate"].values()}
        assert kinds == {"expert", "whole"}            # (1, 2, 2): no tensor parallelism


@pytest.mark.multirank
def test_four_rank_checkpoints_load_on_one_process(run):
    root, _, ref = run
    model, opt, _ = cases.build(None)
    assert checkpoint.load(f"{root}/resumed", model, opt) == cases.TRAIN.steps
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, ref["params"][name], **TOL)
        mine, theirs = opt.state[p], ref["opt"].state[dict(ref["model"].named_parameters())[name]]
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine[k], theirs[k], **TOL)
        assert float(mine["step"]) == cases.TRAIN.steps
    # the checkpoint taken with MP and ESP resumes in one process too
    model, opt, topo = cases.build(None)
    assert checkpoint.load(f"{root}/saved", model, opt) == cases.SAVE_AT
    loss = cases.train_step(model, opt, topo, cases.SAVE_AT)
    assert loss == pytest.approx(ref["losses"][cases.SAVE_AT], rel=1e-10)


@pytest.mark.multirank
def test_another_model_is_refused_naming_the_tensors(run):
    root, _, _ = run
    other = GPT(cases.CFG.replace(moe={"num_experts": 8})).double()
    with pytest.raises(ConfigError, match=r"saved from another model: .*experts.w1/expert/4.*"
                                          r"use the model options of its run"):
        checkpoint.load(f"{root}/saved", other, None)
    wider = GPT(cases.CFG.replace(d_ff=32)).double()
    with pytest.raises(ConfigError, match=r"another shape \(e.g. model/blocks.0.ffn.up.weight: "
                                          r"\(24, 16\) saved, \(32, 16\) here"):
        checkpoint.load(f"{root}/saved", wider, None)


def test_qkv_of_older_checkpoints_loads(tmp_path):
    """Before tensor parallelism qkv was stored as (3 d_model, d_model)."""
    model = GPT(cases.CFG)
    state = checkpoint.checkpoint_state(model, None, torch.tensor(7))
    assert state["model/blocks.0.attn.qkv.weight"].shape == (3, 16, 16)
    old = {k: (v.reshape(48, 16) if k.endswith("qkv.weight") else v) for k, v in state.items()}
    with checkpoint._single_process_ok():
        dcp.save(old, checkpoint_id=str(tmp_path / "old"))
    fresh = GPT(cases.CFG.replace(seed=9))
    assert checkpoint.load(str(tmp_path / "old"), fresh, None) == 7
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
