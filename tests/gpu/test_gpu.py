"""One GPU against the CPU float64 reference: the MoE layer (capacity and dropless, codecs,
schedules; fp32 and bf16 autocast) and the small GPT; and the layer's host-sync budget under
``torch.cuda.set_sync_debug_mode``. Skips without CUDA (tests/conftest.py); the machinery is
in tests/helpers/gpu_cases.py and checked on CPU by tests/unit/cuda/test_cpu_checks_for_gpu.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers import gpu_cases as gc

pytestmark = pytest.mark.gpu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _full_fp32_matmuls():
    """fp32 means fp32: no TF32 in matmuls (a 1e-3 error would hide in the bf16 bound only)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", gc.LAYER_CASES)
def test_layer_cases_on_gpu(name, dtype):
    gc.check_layer(name, "cuda", DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("schedule,r", gc.SCHEDULES, ids=[f"{s}-r{r}" for s, r in gc.SCHEDULES])
@pytest.mark.parametrize("codec", gc.CODEC_NAMES)
@pytest.mark.parametrize("name", ["capacity_k2", "dropless_k2"])
def test_layer_codecs_and_schedules_on_gpu(name, codec, schedule, r, dtype):
    gc.check_layer(name, "cuda", DTYPES[dtype], codec, schedule, r)


# bf16 routes every token to every expert (top_k = num_experts): with top-2, a near tie of
# two bf16 logits may legitimately pick another expert than float64 does
@pytest.mark.parametrize("dtype,top_k,capacity_factor", [
    ("fp32", 2, 1.25), ("fp32", 2, None), ("bf16", 4, None), ("bf16", 4, 1.0)])
def test_gpt_on_gpu(dtype, top_k, capacity_factor):
    gc.check_gpt(gc.gpt_config(top_k, capacity_factor), "cuda", DTYPES[dtype])


# ------------------------------------------------------------------------------- host syncs

def _sync_warnings(fn) -> list[str]:
    """Messages of the synchronising CUDA calls ``fn`` makes (sync debug mode "warn")."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("codec", ["none", "int8", "zfp"])
@pytest.mark.parametrize("schedule,r", [("sequential", 1), ("optsche", 2)])
@pytest.mark.parametrize("capacity_factor,budget", [(1.25, 0), (None, 1)],
                         ids=["capacity", "dropless"])
def test_host_sync_budget_on_gpu(capacity_factor, budget, schedule, r, codec):
    """Capacity mode: no synchronising call in forward + backward; dropless: exactly one (the
    copy of the row counts to the host)."""
    from moeflow import MoEConfig, MoELayer

    cfg = MoEConfig(d_model=64, d_expert=128, num_experts=8, top_k=2,
                    capacity_factor=capacity_factor, codec=codec, codec_backward=True,
                    schedule=schedule, pipeline_degree=r, seed=1)
    layer = MoELayer(cfg).cuda()
    x = torch.randn(256, 64, device="cuda")

    def step():
        xi = x.detach().requires_grad_()
        y = layer(xi)
        (y.square().mean() + layer.aux_loss).backward()

    step()                                   # warm-up: kernels compiled, handles created
    got = _sync_warnings(step)
    assert len(got) == budget, got
    # the sync debug mode is live: a host read of the output is caught
    assert len(_sync_warnings(lambda: layer(x).sum().item())) >= 1 + budget
