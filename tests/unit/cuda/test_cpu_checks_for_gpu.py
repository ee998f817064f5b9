"""The GPU suite's machinery (tests/helpers/gpu_cases.py, tests/helpers/triton_checks.py) checked on CPU: the
comparisons pass on CPU at fp32 and bf16 autocast within their tolerances and fail on wrong
results, the documented codec bounds hold, near-tie tokens are filtered, the train command
parses, metrics and timeline helpers decide correctly."""

from __future__ import annotations

import json
import types

import pytest
import torch

from moeflow.comm.codecs import CODECS
from moeflow.schedule.executor import TaskRecord
from moeflow.schedule.tasks import Task
from tests.helpers import gpu_cases as gc


@pytest.mark.parametrize("name,codec,schedule,r,dtype", [
    ("capacity_k2", "none", "sequential", 1, torch.float32),
    ("dropless_k2", "int8", "optsche", 2, torch.bfloat16),
    ("bigmac_k8", "zfp", "pipelined", 2, torch.float32),
    ("hot_expert_capacity", "fp8", "optsche", 2, torch.bfloat16),
])
def test_layer_check_passes_on_cpu(name, codec, schedule, r, dtype):
    """The same comparison the GPU runs, on CPU (fp32, and bf16 autocast on CPU)."""
    gc.check_layer(name, "cpu", dtype, codec, schedule, r)


def test_layer_check_catches_wrong_results():
    x, g = gc.robust_batch("dropless_k2", torch.float32)
    ref = gc.reference("dropless_k2", x, g)
    tol = gc.tolerance(torch.float32, "none", x)
    good = gc.run_layer(gc.make_layer("dropless_k2"), x, g, "cpu", torch.float32)
    gc.compare_layer(good, ref, tol, "good")
    other_seed = gc.make_layer("dropless_k2")
    other_seed.experts.w2.data.mul_(1 + 1e-3)            # a 0.1% bug in one weight
    with pytest.raises(AssertionError, match="relative error"):
        gc.compare_layer(gc.run_layer(other_seed, x, g, "cpu", torch.float32), ref, tol, "bad")
    # bf16's tolerance still catches a token sent to a wrong expert
    bad = {**good, "y": good["y"].clone()}
    bad["y"][0] = -bad["y"][0]
    with pytest.raises(AssertionError, match="output"):
        gc.compare_layer(bad, ref, gc.COMPUTE_TOL[torch.bfloat16], "flipped token")


@pytest.mark.parametrize("name", gc.CODEC_NAMES + ["zfp8"])
def test_documented_codec_bounds_hold(name):
    """codec_bound transcribes Codec.error_bound: the CPU round trip stays within it."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 300, generator=gen) * torch.exp(2 * torch.randn(64, 1, generator=gen))
    args = {} if name == "zfp8" else gc.CODEC_ARGS.get(name, {})
    codec_name = "zfp" if name == "zfp8" else name
    codec = CODECS[codec_name](**args)
    back = codec.decode(codec.encode(x), torch.float32).double()
    err = (back - x.double()).abs()
    bound = gc.codec_bound(codec_name, x, **args)
    assert (err <= bound).all(), float((err - bound).max())
    if codec_name != "none":
        assert err.max() > 0 and gc.codec_rel_bound(codec_name, x) < (1.0 if name == "zfp8"
                                                                        else 0.07)


def test_robust_batch_drops_near_ties():
    layer = gc.make_layer("capacity_k2")
    w = layer.router.weight.detach()
    x = torch.randn(3, gc.D_MODEL, dtype=torch.float64)
    # token 0: logits of experts 1 and 2 equal up to 1e-9 and the top two: a tie at k=2
    logits = x @ w
    target = torch.full((8,), -1.0, dtype=torch.float64)
    target[0], target[1], target[2] = 1.0, 0.5, 0.5 - 1e-9
    x[0] = torch.linalg.lstsq(w.T, target).solution
    ok32 = gc.routing_margin_ok(layer, x, torch.float32)
    ok16 = gc.routing_margin_ok(layer, x, torch.bfloat16)
    assert not ok32[0] and not ok16[0]
    assert ok16.sum() <= ok32.sum()
    xb, gb = gc.robust_batch("capacity_k2", torch.bfloat16)
    assert xb.shape == (gc.TOKENS, gc.D_MODEL) and gc.routing_margin_ok(
        layer, xb, torch.bfloat16).all()
    assert logits.shape == (3, 8)


@pytest.mark.parametrize("dtype,top_k,capacity_factor", [
    (torch.float32, 2, 1.25), (torch.bfloat16, 4, None)])
def test_gpt_check_passes_on_cpu(dtype, top_k, capacity_factor):
    gc.check_gpt(gc.gpt_config(top_k, capacity_factor), "cpu", dtype)


def test_train_command_follows_the_parser():
    from moeflow.cli import build_parser

    flags = gc.train_parser_flags()
    assert {"--steps", "--nproc", "--out"} <= flags
    cmd = gc.train_command("/tmp/x", 50)
    args = build_parser().parse_args(cmd[3:])
    assert args.command == "train" and args.steps == 50 and args.nproc == 1
    assert ("--device" in cmd) == ("--device" in flags)
    with_flags = gc.train_command("/tmp/x", 50, flags=flags | {"--device", "--dtype"})
    assert with_flags[-4:] == ["--device", "cuda", "--dtype", "bf16"]


def test_check_metrics_decides():
    rec = [{"step": 0, "val_loss": 5.5}] + [
        {"step": s, "loss": 5.4 - 0.04 * s} for s in range(5, 51, 5)]
    rec[-1]["val_loss"] = 3.0
    lines = [json.dumps(r) for r in rec]
    assert gc.check_metrics(lines, 50)["train"] == (5.2, pytest.approx(3.4))
    flat = [json.dumps({**r, "loss": 5.4}) if "loss" in r else json.dumps(r) for r in rec]
    with pytest.raises(AssertionError, match="did not fall"):
        gc.check_metrics(flat, 50)
    with pytest.raises(AssertionError):
        gc.check_metrics(lines[:-1], 50)


def _rec(kind, chunk, lane, start, end, phase="forward"):
    return TaskRecord(Task(kind, chunk), phase, lane, start, end, 0)


def test_overlap_helpers():
    recs = [_rec("C1", 0, "compute", 0, 1), _rec("A1", 0, "comm", 1, 2),
            _rec("E", 0, "compute", 2, 4), _rec("A1", 1, "comm", 2.5, 3.5),
            _rec("E", 1, "compute", 4, 5), _rec("A2", 0, "comm", 4.5, 6, "backward")]
    assert gc.overlapping_pairs(recs) == [("A1^1", "E^0", 1.0)]
    assert gc.lanes_of(recs)["A1"] == {"comm"} and gc.lanes_of(recs)["E"] == {"compute"}


def test_device_wrappers_keep_strides_and_count_calls():
    from tests.helpers import triton_checks as tc

    base = torch.arange(40.0).view(4, 10)
    view = base[:, 3:8]
    moved = tc.to_device([view, (view, 3)], "meta")
    assert moved[0].device.type == "meta" and moved[0].stride() == (10, 1)
    assert moved[1][1] == 3 and moved[1][0].shape == (4, 5)
    mod = types.SimpleNamespace(double=lambda t, k=2: [t * k, t.stride()])
    with tc.on_device([(mod, "double")], "cpu") as calls:
        out, stride = mod.double(view, k=3)
    assert calls == {"double": 1} and torch.equal(out, view * 3) and stride == (10, 1)
    assert mod.double(view)[1] == (10, 1)                 # restored
