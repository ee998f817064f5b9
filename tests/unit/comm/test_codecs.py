"""Plain codecs (fp16, bf16, int8, fp8) and every registered codec's contract: round trip within
the documented bound, wire size as declared, clear errors, gradients through the MoE layer."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.comm.codecs import CODECS
from moeflow.launch import launch_local
from tests.helpers import codec_cases

try:
    import zfpy  # noqa: F401
    HAVE_ZFPY = True
except ImportError:                                   # the "test" extra installs it
    HAVE_ZFPY = False

ALL = ["none", "fp16", "bf16", "int8", "fp8", "fp8-row", "zfp"] + (["zfpy"] if HAVE_ZFPY else [])


def _data(rows=33, cols=130, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[3] *= 1e3                                     # rows of very different scales
    x[4] *= 1e-3
    x[5] = 0.0
    x[6] = 2.5                                      # constant row
    return x


def _payload_bytes(payloads):
    return sum(p.numel() * p.element_size() for p in payloads)


@pytest.mark.parametrize("name", ALL)
def test_wire_size_is_declared_and_rows_stay_first(name):
    codec = CODECS[name]()
    for rows, cols in [(33, 130), (1, 4), (7, 3), (0, 16), (5, 0)]:
        x = torch.randn(rows, cols)
        payloads = codec.encode(x)
        assert all(p.shape[0] == rows for p in payloads)
        assert _payload_bytes(payloads) == codec.wire_bytes(rows, cols, x.dtype)
        if rows:
            assert codec.decode(payloads, x.dtype).shape == x.shape


def test_cast_codecs_bounds():
    x = _data()
    x = x[x.abs().amax(1) < 6e4]                    # fp16's range
    for name, rel in [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)]:
        c = CODECS[name]()
        y = c.decode(c.encode(x), torch.float32)
        assert ((y - x).abs() <= rel * x.abs() + 2.0 ** -25).all(), name


def test_int8_bound():
    x = _data()
    c = CODECS["int8"]()
    y = c.decode(c.encode(x), torch.float32)
    span = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True))
    assert ((y - x).abs() <= span / 510 * (1 + 1e-5) + 1e-6 * x.abs().amax(1, keepdim=True)).all()
    assert torch.equal(y[6], x[6]) and torch.equal(y[5], x[5])


@pytest.mark.parametrize("name,block", [("fp8", 128), ("fp8-row", None)])
def test_fp8_bound(name, block):
    x = _data()
    c = CODECS[name]()
    y = c.decode(c.encode(x), torch.float32)
    cols = x.shape[1]
    bs = cols if block is None else block
    amax = torch.zeros_like(x)
    for s in range(0, cols, bs):
        amax[:, s:s + bs] = x[:, s:s + bs].abs().amax(1, keepdim=True)
    bound = x.abs() / 16 + amax * 2.0 ** -10 / 448
    assert ((y - x).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(y[5], x[5])
    # the bound is reached, not loose by orders of magnitude
    assert ((y - x).abs() / x.abs().clamp(min=1e-30))[x.abs() > amax / 64].max() > 2.0 ** -6


def test_fp8_keeps_row_scale_apart():
    x = torch.tensor([[1e-3] * 4 + [1e3] * 4])
    y = CODECS["fp8-row"]().decode(CODECS["fp8-row"]().encode(x), torch.float32)
    # one scale for the row: 1e-3 falls in e4m3's subnormals but stays within the bound
    assert ((y - x).abs() <= x.abs() / 16 + 1e3 * 2.0 ** -10 / 448 + 1e-9).all()


@pytest.mark.parametrize("name", ALL[1:])          # "none" moves any tensor as it is
def test_bad_dtype_and_shape_fail_clearly(name):
    codec = CODECS[name]()
    with pytest.raises(ValueError, match="does not take"):
        codec.encode(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="rows, cols"):
        codec.encode(torch.ones(2, 3, 4))


@pytest.mark.parametrize("name", ALL)
def test_fp16_and_bf16_inputs(name):
    codec = CODECS[name]()
    for dt in (torch.float16, torch.bfloat16):
        x = torch.randn(5, 12).to(dt)
        y = codec.decode(codec.encode(x), dt)
        assert y.dtype == dt and y.shape == x.shape
        assert (y.float() - x.float()).abs().max() < 0.5


@pytest.mark.parametrize("name", ALL)
def test_gradients_flow_through_the_layer(name):
    cfg = mf.MoEConfig(d_model=16, d_expert=24, num_experts=4, top_k=2, codec=name)
    layer = mf.MoELayer(cfg)
    x = torch.randn(9, 16, requires_grad=True)
    y = layer(x)
    (y.square().sum() + layer.aux_loss).backward()
    ref = mf.MoELayer(cfg.replace(codec="none"))
    xr = x.detach().clone().requires_grad_()
    yr = ref(xr)
    (yr.square().sum() + ref.aux_loss).backward()
    tol = {"none": 0, "fp16": 2e-3, "bf16": 2e-2, "int8": 3e-2, "fp8": 0.1, "fp8-row": 0.1,
           "zfp": 0.1, "zfpy": 0.1}[name]
    rel = lambda a, b: float((a - b).detach().norm() / b.detach().norm())
    assert rel(y, yr) <= tol and rel(x.grad, xr.grad) <= 2 * tol
    for (n, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


@pytest.mark.multirank
def test_two_ranks_each_codec_close_to_none():
    names = ALL
    res = launch_local(codec_cases.codec_worker, 2, names, timeout_s=180)
    tol = {"fp16": 2e-3, "bf16": 2e-2, "int8": 3e-2, "fp8": 0.1, "fp8-row": 0.1, "zfp": 0.1,
           "zfpy": 0.1, "none": 0.0}
    for rank in (0, 1):
        ref = res[rank]["none"]
        for name in names:
            got = res[rank][name]
            rel_y = float((got["y"] - ref["y"]).norm() / ref["y"].norm())
            rel_g = float((got["x_grad"] - ref["x_grad"]).norm() / ref["x_grad"].norm())
            assert rel_y <= tol[name] and rel_g <= 2 * tol[name], (name, rank, rel_y, rel_g)
            assert (rel_y > 0) == (name != "none") or name in ("fp16",)
        if HAVE_ZFPY:   # zfp (ours) and zfpy (LLNL) move identical bytes: identical results
            torch.testing.assert_close(res[rank]["zfp"]["y"], res[rank]["zfpy"]["y"], rtol=0,
                                       atol=0)
