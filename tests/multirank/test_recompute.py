"""MoE recompute (moeflow/schedule/pipeline.py, "Recomputation"): how often one forward +
backward runs the layer's forward under ``torch.utils.checkpoint`` (counted by a hook on the
router), and float64 gradients with and without recomputation (``MoEConfig.recompute``,
``moeflow train --recompute``)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp

import moeflow as mf
from moeflow.config import ConfigError, TrainConfig

CASES = {"r1": {}, "r4": dict(schedule="pipelined", pipeline_degree=4),
         "r4_optsche": dict(schedule="optsche", pipeline_degree=4),
         "shared": dict(num_shared_experts=1),
         "r4_shared": dict(schedule="pipelined", pipeline_degree=4, num_shared_experts=1)}


def _run(kw: dict, checkpoint: bool | None, recompute: str = "none"):
    """(router forwards, grads) of ``sum y^2`` through one layer; ``checkpoint``: None (no
    checkpointing) or use_reentrant."""
    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, capacity_factor=1.0,
                       recompute=recompute, **kw)
    layer = mf.MoELayer(cfg, attach_aux_loss=True).double().train()
    calls = [0]
    layer.router.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                    requires_grad=True)
    y = layer(x) if checkpoint is None else cp.checkpoint(layer, x, use_reentrant=checkpoint)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    grads["input"] = x.grad.clone()
    return calls[0], grads


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("checkpoint", [True, False])
@pytest.mark.parametrize("recompute", ["none", "moe_act"])
def test_checkpointed_layer_runs_its_forward_twice(case, checkpoint, recompute):
    """The forward once, the recomputation once: 2 at any r and with shared experts, in both
    checkpointing modes (non-reentrant checkpointing used to rerun the layer once per nested
    autograd.grad of its backward: 3 at r = 1, 6 at r = 4)."""
    assert _run(CASES[case], checkpoint, recompute)[0] == 2
    assert _run(CASES[case], None, recompute)[0] == 1


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", [("none", True), ("none", False), ("moe_act", None),
                                  ("moe_act", False)])
def test_recomputed_gradients_equal_the_stored_ones(case, mode):
    recompute, checkpoint = mode
    _, ref = _run(CASES[case], None)
    _, got = _run(CASES[case], checkpoint, recompute)
    assert ref.keys() == got.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-12, atol=1e-15, msg=n)


def _scheduled_node(recompute: str):
    cfg = mf.MoEConfig(d_model=8, d_expert=64, num_experts=4, top_k=2, capacity_factor=None,
                       recompute=recompute)
    layer = mf.MoELayer(cfg).double().train()
    y = layer(torch.randn(32, 8, dtype=torch.float64, requires_grad=True))
    todo, seen = [y.grad_fn], set()
    while todo:                                   # the layer's exchange + experts node
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Scheduled" in type(node).__name__:
            return node
        todo.extend(f for f, _ in node.next_functions)
    raise AssertionError("no _Scheduled node in the graph")


def test_moe_act_keeps_the_inputs_not_the_hidden_activations():
    """``moe_act``: the layer's autograd node holds the experts' input rows (T*k x d_model),
    as saved tensors, and no expert graph (whose hidden activations are T*k x d_expert);
    ``none`` holds the graphs."""
    plain = _scheduled_node("none")
    assert plain.inputs_only is False and plain.saved[0][1].grad_fn is not None
    act = _scheduled_node("moe_act")
    assert act.inputs_only is True and act.saved is None
    assert [tuple(t.shape) for t in act.saved_tensors] == [(64, 8)]


@pytest.mark.parametrize("bad", ["full", "act", None])
def test_moe_recompute_is_validated(bad):
    with pytest.raises(ConfigError, match=r"MoEConfig.recompute=.*choose 'none'.*'moe_act'"):
        mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, recompute=bad)


def test_train_recompute_is_validated():
    with pytest.raises(ConfigError, match=r"^--recompute: TrainConfig.recompute='selective'"):
        TrainConfig(recompute="selective")


@pytest.mark.multirank
def test_trainer_recompute_modes_train_the_same_function(tmp_path):
    from moeflow.launch import launch_local
    from tests.helpers import recompute_cases

    results = launch_local(recompute_cases.worker, 2, str(tmp_path), timeout_s=300)
    for r in results.values():
        ref = r["none"]
        # forwards per MoE layer: the step-0 and final evaluations (1 batch each) and one per
        # micro-batch of the 2 steps, plus one rerun per micro-batch under full recompute
        layers = len(r["none"]["moe_recompute"])
        assert ref["forwards"] == layers * (2 + 2)
        assert r["moe_act"]["forwards"] == ref["forwards"]
        assert r["moe_act"]["moe_recompute"] == ["moe_act"] * layers
        assert r["full"]["forwards"] == ref["forwards"] + layers * 2   # one rerun per step
        assert r["full_accum2"]["forwards"] == layers * (2 + 2 * 2 * 2)
        # (micro-batches have their own capacity and balancing loss: compared with accum2)
        assert r["fssdp_full"]["forwards"] == r["fssdp_none"]["forwards"] + layers * 2
        assert r["fssdp_moe_act"]["forwards"] == r["fssdp_none"]["forwards"]
        assert r["fssdp_moe_act"]["moe_recompute"] == ["moe_act"] * layers
        for name, ref in (("full", r["none"]), ("moe_act", r["none"]),
                          ("full_accum2", r["accum2"]), ("fssdp_full", r["fssdp_none"]),
                          ("fssdp_moe_act", r["fssdp_none"])):
            assert r[name]["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
            for n in ref["params"]:
                torch.testing.assert_close(r[name]["params"][n], ref["params"][n], rtol=1e-4,
                                           atol=1e-5, msg=f"{name}: {n}")


def test_fssdp_accepts_moe_act_recomputation():
    """FSSDP's backward holds the call's experts anyway (the held copy, or HECATE-RM's second
    spAG), so moe_act is accepted with it, by the layer's config and by ``moeflow train``."""
    from moeflow.commands.train_command import check_layout
    from moeflow.config import ModelConfig

    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, placement="fssdp",
                       recompute="moe_act")
    assert cfg.recompute == "moe_act"
    mcfg = ModelConfig(n_layers=2, seq_len=16, d_model=32, n_heads=2, d_ff=64,
                       moe=dict(num_experts=4, d_expert=32, placement="fssdp"))
    for mode in ("moe_act", "full"):
        check_layout(mcfg, TrainConfig(recompute=mode), 2)


def _fssdp_moe_act(variants: list[str]) -> dict:
    from moeflow.launch import launch_local
    from tests.helpers import fssdp_recompute_worker as worker

    return launch_local(worker.worker, 4, variants, timeout_s=300)


def _check_fssdp_moe_act(results: dict, variant: str, rematerialize: bool) -> None:
    """moe_act against none, per AdamW step: outputs, input / expert / dense gradients,
    parameters after the step and ``P'`` equal in float64; moe_act kept the input rows (none
    the graphs); HECATE-RM still frees the held experts between forward and backward."""
    for rank, res in results.items():
        assert res[variant, "none", "kept_inputs"] == [False] * 2, rank
        assert res[variant, "moe_act", "kept_inputs"] == [True] * 2, rank
        for step, (got, ref) in enumerate(zip(res[variant, "moe_act"], res[variant, "none"])):
            for key in ("y", "x_grad", "grads", "dense_grads", "params", "dense_params"):
                want, have = ref[key], got[key]
                for k in (want if isinstance(want, dict) else [None]):
                    torch.testing.assert_close(
                        have if k is None else have[k], want if k is None else want[k],
                        rtol=1e-12, atol=1e-14, msg=f"rank {rank} step {step} {key} {k}")
            assert got["holders"] == ref["holders"], (rank, step)
            held = got["counts"]["held_bytes"]
            assert held == ref["counts"]["held_bytes"], (rank, step)
            assert (held == 0) == rematerialize, (rank, step, held)


@pytest.mark.multirank
@pytest.mark.slow   # the holding variant below and the trainer's fssdp_moe_act (above) run by default
def test_fssdp_moe_act_equals_none_with_rematerialization():
    """HECATE-RM (Algorithm 1 from the load window, calibration), r = 1, 4 float64 ranks."""
    _check_fssdp_moe_act(_fssdp_moe_act(["fssdp_rm_r1"]), "fssdp_rm_r1", True)


@pytest.mark.slow
@pytest.mark.multirank
def test_fssdp_moe_act_equals_none_holding_the_experts():
    """Without re-materialization (the held experts kept until backward), r = 2 OptSche."""
    _check_fssdp_moe_act(_fssdp_moe_act(["fssdp_keep_r2"]), "fssdp_keep_r2", False)
