"""MoEConfig.fssdp.overlap_regather (HECATE Section 3.2, HECATE-RM's second spAG under the
attention backward): on 4 float64 ranks (2 nodes x 2), GPTs with Algorithm 1 and
re-materialization give the same logits, losses, gradients and parameters after AdamW steps
with the re-gather launched early on the lane as with it on the critical path, with and
without the spRS on the lane; the re-gather really ran on the lane, once per layer and step,
and moved the same bytes. Refusals: without ``rematerialize``, and under ``--recompute full``.
"""

from __future__ import annotations

import pytest
import torch

from moeflow.config import ModelConfig, TrainConfig
from moeflow.errors import ConfigError
from moeflow.launch import launch_local
from moeflow.strategies.fssdp.options import FSSDPOptions
from tests.helpers import fssdp_regather_worker as rw

TOL = dict(rtol=1e-12, atol=1e-14)


_LAUNCHED: dict[str, dict] = {}
# the dense-between model is the same mechanism with a dense block's attention as trigger:
# marked slow (one more 4-rank launch)
MODELS = ["all_moe", pytest.param("dense_between", marks=pytest.mark.slow)]


def results(model: str) -> dict:
    if model not in _LAUNCHED:
        _LAUNCHED[model] = launch_local(rw.worker, 4, [model], timeout_s=180)
    return _LAUNCHED[model]


def _same(a: dict, b: dict, label: str, exact: bool) -> None:
    for step, (x, y) in enumerate(zip(a["steps"], b["steps"])):
        for key in ("logits", "loss"):
            if exact:
                assert torch.equal(x[key], y[key]), f"{label} step {step}: {key} differs"
            torch.testing.assert_close(y[key], x[key], **TOL)
        for kind in ("grads", "params"):
            assert sorted(x[kind]) == sorted(y[kind]), f"{label} step {step} {kind}"
            for name, v in y[kind].items():
                if exact:
                    assert torch.equal(v, x[kind][name]), f"{label} step {step} {kind} {name}"
                torch.testing.assert_close(v, x[kind][name], **TOL,
                                           msg=lambda m: f"{label} step {step} {kind} {name}: {m}")


@pytest.mark.multirank
@pytest.mark.parametrize("model", MODELS)
def test_early_regather_trains_the_same(model):
    for rank, got in results(model).items():
        # the re-gather only moves bytes earlier: bit-identical with the spRS in place; with
        # the spRS on the lane both sides add its rows the same way (same comparison)
        _same(got[model, "off"], got[model, "on"], f"{model} rank {rank}", exact=True)
        _same(got[model, "off_sprs_lane"], got[model, "on_sprs_lane"],
              f"{model} sprs lane rank {rank}", exact=True)
        _same(got[model, "off"], got[model, "on_sprs_lane"], f"{model} both rank {rank}",
              exact=False)


@pytest.mark.multirank
@pytest.mark.parametrize("model", MODELS)
def test_the_regather_ran_on_the_lane(model):
    res = results(model)
    n_moe = len(res[0][model, "on"]["regather_on_lane"])
    assert n_moe == 2
    for got in res.values():
        for v in ("on", "on_sprs_lane"):
            assert got[model, v]["regather_on_lane"] == [rw.STEPS] * n_moe, v
        for v in ("off", "off_sprs_lane"):
            assert got[model, v]["regather_on_lane"] == [0] * n_moe, v
        assert got[model, "on"]["spag_backward"] == got[model, "off"]["spag_backward"]
    # Algorithm 1 replicated experts in the last step, and the re-gather moved them
    assert all(r > 0 for r in res[0][model, "on"]["replicated"])
    assert sum(got[model, "on"]["spag_backward"][0][0] for got in res.values()) > 0


def test_overlap_regather_is_validated():
    assert FSSDPOptions().overlap_regather is False
    with pytest.raises(ConfigError, match=r"fssdp.overlap_regather='yes' is invalid"):
        FSSDPOptions(overlap_regather="yes", rematerialize=True)
    with pytest.raises(ConfigError, match=r"overlap_regather=True is invalid with "
                                          r"rematerialize=False.*set rematerialize=True"):
        FSSDPOptions(overlap_regather=True)
    assert FSSDPOptions.coerce({"rematerialize": True,
                                "overlap_regather": True}).overlap_regather


def test_refused_under_full_recompute():
    from moeflow.models.gpt import GPT
    from moeflow.trainer import build_config

    cfg = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                      moe_every=1, moe=dict(num_experts=2, d_expert=12, top_k=1, placement="fssdp",
                                            fssdp=dict(rematerialize=True, overlap_regather=True)))
    with pytest.raises(ConfigError, match=r"recompute='full' is invalid with "
                                          r"MoEConfig.fssdp.overlap_regather=True"):
        build_config(cfg, TrainConfig(recompute="full"))
    assert build_config(cfg, TrainConfig(recompute="none")) is cfg
    gpt = GPT(cfg)                      # a library user setting the flag directly
    gpt.checkpoint_blocks = True
    idx = torch.zeros((1, 8), dtype=torch.long)
    with pytest.raises(ConfigError, match=r"overlap_regather=True \(MoE layer 0\) is invalid "
                                          r"with activation recomputation"):
        gpt(idx, idx)
    with torch.no_grad():               # no backward, no recomputation: allowed
        gpt(idx, idx)
