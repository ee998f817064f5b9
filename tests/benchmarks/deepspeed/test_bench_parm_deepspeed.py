"""``moeflow bench parm --compare deepspeed`` without DeepSpeed: the skip, the argument checks.

The comparison itself needs deepspeed (an optional peer, not a dependency) and 4 or 8 ranks; it is
run by hand (docs/benchmarks/parm.md, "Against DeepSpeed-MoE"), not in CI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.deepspeed import parm_deepspeed as pd
from moeflow.cli import main
from benchmarks.parm import commands as bench_parm

SMALL = ["bench", "parm", "--compare", "deepspeed", "--nproc", "4", "--tokens", "64",
         "--d-model", "32", "--reps", "1"]


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any rank would be started."""
    def refuse(*a, **k):
        raise AssertionError("ranks were started")
    monkeypatch.setattr(bench_parm, "run_on_ranks", refuse)


def test_skips_with_a_message_when_deepspeed_is_absent(monkeypatch, capsys, no_ranks):
    monkeypatch.setattr(pd, "deepspeed_available", lambda: False)
    assert main([*SMALL, "--capacity-factors", "1.25"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == pd.SKIP_MESSAGE
    assert "Against DeepSpeed-MoE" in out and "not importable" in out


def test_availability_follows_the_import_system(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert pd.deepspeed_available() is False
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert pd.deepspeed_available() is True


@pytest.mark.parametrize("argv,message", [
    # ceil(2 * 1.2 * 64 / 4) = 39: DeepSpeed cannot split it over N_MP = 2
    (["--capacity-factors", "1.2"], "--tokens 64 with capacity factor 1.2"),
    (["--capacity-factors", "1.25", "--top-k", "3"], "--top-k 3 must be 1 or 2"),
])
def test_bad_arguments_are_clear_errors_before_any_rank(monkeypatch, no_ranks, argv, message):
    monkeypatch.setattr(pd, "deepspeed_available", lambda: False)   # checked before the skip
    with pytest.raises(SystemExit) as err:
        main([*SMALL, *argv])
    assert message in str(err.value.code)


def test_unknown_peer_is_rejected(capsys):
    with pytest.raises(SystemExit) as err:
        main([*SMALL, "--compare", "tutel"])
    assert err.value.code == 2
    assert "invalid choice: 'tutel'" in capsys.readouterr().err


@pytest.mark.parametrize("tokens,k,E,f,ok", [(512, 2, 4, 1.25, True), (512, 2, 4, 2.4, False),
                                             (2048, 2, 4, 1.2, False), (64, 2, 4, 2.0, True)])
def test_capacity_divides(tokens, k, E, f, ok):
    assert pd.capacity_divides(tokens, k, E, f, 2) is ok


@pytest.mark.parametrize("world,ep", [(4, 2), (8, 4)])
def test_ep_for_world_keeps_mp_as_esp(world, ep):
    assert pd.ep_for_world(world) == ep


@pytest.mark.parametrize("world", [2, 3, 5])
def test_ep_for_world_rejects_worlds_without_an_ep_group(world):
    with pytest.raises(SystemExit, match=f"not {world}"):
        pd.ep_for_world(world)


def test_capacity_check_uses_the_world_size_of_torchrun(monkeypatch, no_ranks):
    # --tokens 40, f 1.5: E = 4 on 4 ranks gives ceil(2 * 1.5 * 40 / 4) = 30, which N_MP = 2
    # splits; E = 8 on 8 ranks (N_EP = 4) gives 15, which it does not
    monkeypatch.setattr(pd, "deepspeed_available", lambda: False)
    args = [*SMALL, "--tokens", "40", "--capacity-factors", "1.5"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(args) == 0
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(SystemExit, match="--tokens 40 with capacity factor 1.5"):
        main(args)


def _result(version: str, labels: list[str]) -> dict:
    cols = labels + [v for v, _ in pd.MOEFLOW_VARIANTS]
    step = {v: 10.0 + i for i, v in enumerate(cols)}
    check = {"tokens_per_rank": 64, "capacity_factor": 2.0, "second_expert_noise": "zeroed"}
    for name in labels:
        check[name] = {"max_abs_diff_output": 1e-7, "max_abs_diff_input_grad": 1e-10,
                       "max_abs_output": 2.0, "tolerance": pd.TOLERANCE, "agrees": True}
    return {"topology": "T", "deepspeed_version": version, "deepspeed_labels": labels,
            "numeric_check": [check],
            "rows": [{"tokens_per_rank": 64, "capacity_factor": 1.25, "auto_choice": "ted",
                      "step_ms": step,
                      "speedup_over_deepspeed": {v: step["deepspeed"] / step[v] for v in cols}}]}


def test_format_names_the_installed_version_and_its_columns():
    old = pd.format_compare(_result("0.8.1", ["deepspeed"]))
    assert "ds 0.8.1" in old and "speedup over ds 0.8.1" in old
    assert "ds 0.8.1 ord" not in old and "(0.8.1's order, run)" in old
    assert "baseline vs deepspeed:" in old and "2nd-expert noise zeroed" in old
    new = pd.format_compare(_result("0.19.8", ["deepspeed", pd.ORDER_081]))
    assert "ds 0.19.8" in new and "ds 0.8.1 ord" in new and "emulated" in new
    assert "baseline vs deepspeed-0.8.1-order" in new
    # the speedup column of the emulation: 10.0 / 11.0
    assert "0.91x" in new.splitlines()[3]
    assert "Algorithm 1 took ted" in new.splitlines()[3]
    assert "auto ran" not in new.splitlines()[3]            # a row from before the confirmation


def test_format_prints_the_measured_autos_choice():
    res = _result("0.19.8", ["deepspeed", pd.ORDER_081])
    res["rows"][0].update(auto_confirmed="ted-r4", auto_measured_ms={"ted": 12.0, "ted-r4": 9.0},
                          auto_confirm_s=0.5, auto_confirm_cut=["s1"])
    line = pd.format_compare(res).splitlines()[3]
    assert "Algorithm 1 took ted, auto ran ted-r4 (measured ms: ted 12, ted-r4 9)" in line


def _layer(parts):
    return SimpleNamespace(strategy=SimpleNamespace(parts=parts))


def test_auto_choice_reads_the_schedule_algorithm1_took():
    took = SimpleNamespace(auto=SimpleNamespace(last=SimpleNamespace(schedule="ted")))
    assert pd.auto_choice(_layer(took)) == "ted"
    assert pd.auto_choice(_layer(None)) == "baseline"       # no MP / ESP: no paused-MP schedule
    with pytest.raises(ValueError, match="has not run"):
        pd.auto_choice(_layer(SimpleNamespace(auto=SimpleNamespace(last=None))))


def test_installed_deepspeed_order_and_sampling_switch():
    """Read from the installed code: 0.8.1 runs no MP collective with tensor-parallel experts
    and has no sampling switch; 0.19.8 drops / gathers and has it."""
    ds = pytest.importorskip("deepspeed")
    expected = {"0.8.1": (False, False), "0.19.8": (True, True)}
    if ds.__version__ not in expected:
        pytest.skip(f"deepspeed {ds.__version__}: only 0.8.1 and 0.19.8 were read")
    assert (pd.drops_mp_duplicates(), pd.has_sampling_switch()) == expected[ds.__version__]
    assert pd.ds_labels() == (["deepspeed", pd.ORDER_081] if pd.drops_mp_duplicates()
                              else ["deepspeed"])


def test_second_expert_noise_is_zeroed_only_inside_the_block():
    pytest.importorskip("deepspeed")
    import torch
    from deepspeed.moe import sharded_moe
    saved = sharded_moe.gumbel_rsample
    with pd.no_second_expert_noise():
        inside = sharded_moe.gumbel_rsample
        if not pd.has_sampling_switch():
            assert torch.equal(inside((3, 4), torch.device("cpu")), torch.zeros(3, 4))
            # 0.8.1's top2gating: the second expert is then the second-largest logit, always
            logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 8)
            _, combine, _, _ = sharded_moe.top2gating(logits, 2.0, 0)
            assert (combine.sum(-1)[:, 1] > 0).all() and (combine.sum(-1)[:, 2:] == 0).all()
        else:
            assert inside is saved      # 0.19.8: the layer's switch does it, nothing patched
    assert sharded_moe.gumbel_rsample is saved


def test_format_prints_moeflows_capacity_padding():
    old = pd.format_compare(_result("0.19.8", ["deepspeed", pd.ORDER_081]))
    assert "moeflow capacity_padding=- (Parm padded)" in old.splitlines()[0]
    res = _result("0.19.8", ["deepspeed", pd.ORDER_081])
    res["capacity_padding"] = "trim"
    res["rows"][0]["trimmed"] = {"ted": True, "ted-r4": True, "s2": False}
    assert ("moeflow capacity_padding=trim (trimmed: ted,ted-r4)"
            in pd.format_compare(res).splitlines()[0])
