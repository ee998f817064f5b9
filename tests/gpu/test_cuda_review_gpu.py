"""GPU checks of the CUDA-path review (docs/gpu.md, "CUDA-path review"); each skips, with the
reason, without the hardware it needs. Their CPU counterparts: tests/unit/cuda/test_cuda_review.py and
tests/multirank/test_cuda_review_rm.py; the Parm worker below also runs on CPU over gloo
(``test_parm_baseline_optsche_worker_on_cpu``), so the comparison itself is proven here.

* Parm baseline with ESP, (N_MP, N_EP, N_ESP) = (2, 1, 2) on 4 GPUs, OptSche at r = 2 (ScheMoE
  Section 3.2), under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron's setting, one hardware
  queue: the communication stream's priority and the lane's ordering must still overlap the
  chunks without deadlock), against the float64 single-process reference.
* FSSDP with HECATE-RM (Section 3.2) under bf16 autocast on 2 GPUs: the CUDA memory held
  between forward and backward drops by at least the held experts' bf16 bytes.
* The fp8 codecs on an sm_80/sm_86 GPU (the integer-cast Triton path) equal the CPU codecs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from moeflow import Topology
from tests.helpers import gpu_multi_cases as gm
from tests.helpers import parity

BACKEND = "cpu:gloo,cuda:nccl"


def _need(ranks: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} CUDA devices (NCCL: one rank per GPU); torch sees "
                    f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL (torch.distributed.is_nccl_available() is False)")


# -- Parm baseline + ESP + OptSche r = 2, one hardware queue ------------------------------------

def parm_optsche_worker(device: str, dtypes: list[str]) -> dict:
    dev = gm.device_of(device)
    topo = gm.parm_topology(int(os.environ["WORLD_SIZE"]))
    out = {"connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    for dtype in dtypes:
        for case in gm.PARM_CASES:
            layer = parity.make_layer(case, topo, parallel_schedule="baseline",
                                      schedule="optsche", pipeline_degree=2)
            out["shard"] = layer.experts.shard
            x, g = gm.robust_batch(case, topo.rank // topo.mp_size, gm.DTYPES[dtype])
            out[case, dtype] = gm.run_rank_layer(layer, x, g, topo, dev, gm.DTYPES[dtype])
    return out


def _check_parm(results: dict, world: int, device: str) -> int:
    n = 0
    for rank in range(world):
        got = results[rank]
        assert got["shard"][1] == 2, got["shard"]                     # ESP really shards
        for (case, dtype), run in ((k, v) for k, v in got.items() if isinstance(k, tuple)):
            dt = gm.DTYPES[dtype]
            ref = gm.parm_reference("s2", case, world, dt)          # whole MP batches
            assert run["device"] == device
            gm.compare_rank(run, ref, rank, world, gm.tolerance(dt),
                            f"parm baseline optsche r=2 {case} {dtype}", shard=got["shard"])
            n += 1
    return n


@pytest.mark.gpu
def test_parm_baseline_esp_optsche_r2_one_hardware_queue_on_four_gpus(monkeypatch):
    _need(4)
    from moeflow.launch import launch_local
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")        # inherited by the ranks
    got = launch_local(parm_optsche_worker, 4, "cuda", list(gm.DTYPES), backend=BACKEND,
                       timeout_s=300)
    assert all(r["connections"] == "1" for r in got.values())
    assert _check_parm(got, 4, "cuda") == 4 * len(gm.PARM_CASES) * len(gm.DTYPES)


@pytest.mark.multirank
def test_parm_baseline_optsche_worker_on_cpu():
    """The same worker and comparison on 4 gloo ranks (fp32), so the GPU test above cannot
    pass or fail for a reason of its own making."""
    from moeflow.launch import launch_local
    got = launch_local(parm_optsche_worker, 4, "cpu", ["float32"], timeout_s=400)
    assert _check_parm(got, 4, "cpu") == 4 * len(gm.PARM_CASES)


# -- FSSDP-RM memory under bf16 autocast --------------------------------------------------------

def rm_memory_worker() -> dict:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda", torch.cuda.current_device())
    topo = Topology.from_env(local_size=2)
    out = {}
    for rm in (False, True):
        layer = parity.make_layer("dropless_k2", topo, placement="fssdp",
                                  fssdp=dict(materialize="manual", rematerialize=rm))
        layer = layer.to(device=dev, dtype=torch.float32)
        owners = layer.experts.owners.owners
        layer.experts.set_holders([{o} | ({1 - o} if e % 2 else set())
                                   for e, o in enumerate(owners)])
        x, g = gm.robust_batch("dropless_k2", topo.rank, torch.bfloat16)
        x, g = x.to(dev, torch.float32).requires_grad_(), g.to(dev, torch.float32)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        ((y.float() * g).sum() / max(1, y.shape[0]) + layer.aux_loss.float()).backward()
        torch.cuda.synchronize()
        out[rm] = {"held": held, "peak": torch.cuda.max_memory_allocated() - before,
                   "bf16_bytes": len(layer.experts.last_placement.held(topo.rank))
                   * layer.experts.numel * 2,
                   "grad": layer.experts.slots.grad.detach().cpu()}
    return out


@pytest.mark.gpu
def test_fssdp_rm_frees_the_held_experts_under_bf16_on_two_gpus():
    _need(2)
    from moeflow.launch import launch_local
    got = launch_local(rm_memory_worker, 2, backend=BACKEND, timeout_s=300)
    for rank, r in got.items():
        plain, rm = r[False], r[True]
        print(f"rank {rank}: held {plain['held']} -> {rm['held']} B, peak {plain['peak']} -> "
              f"{rm['peak']} B, held experts {rm['bf16_bytes']} B in bf16")
        assert plain["held"] - rm["held"] >= rm["bf16_bytes"] > 0, (rank, plain, rm)
        assert torch.equal(plain["grad"], rm["grad"]), rank


# -- fp8 on a GPU without hardware float8 --------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8", "fp8-row"])
def test_fp8_codecs_on_sm80_equal_the_cpu_codecs(name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cap = torch.cuda.get_device_capability()
    if not (8, 0) <= cap < (8, 9):
        pytest.skip(f"needs an sm_80/sm_86 GPU (no hardware float8); this one is sm_{cap[0]}"
                    f"{cap[1]}")
    tq = pytest.importorskip("moeflow.comm.codecs.triton_quant")
    if not tq.available():
        pytest.skip("triton not installed")
    from moeflow.comm.codecs import CODECS
    codec = CODECS[name]()
    assert tq.hardware_fp8("cuda") is False
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-9, 500.0, -448.0])
    want = codec.encode(x)
    got = codec.encode(x.cuda())
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b), name
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(codec.decode(got, dt).cpu(), codec.decode(want, dt)), (name, dt)
