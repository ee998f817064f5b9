"""Multi-GPU parity over NCCL (one rank per GPU, ``backend="cpu:gloo,cuda:nccl"``), float32
and bf16 autocast against the CPU float64 references at the single-GPU suite's tolerances
(``tests/gpu_cases.COMPUTE_TOL``): Parm S1 / S2-SAA / S2-AAS at (N_MP, N_EP, N_ESP) = (2, 1, 1)
on 2 GPUs and (2, 1, 2) on 4, FSSDP with a skewed P' on 2 GPUs, one step of the
tensor-parallel GPT at mp = 2 on 2 GPUs. The rank workers are tests/helpers/gpu_multi_cases.py, proven
on CPU with gloo by tests/multirank/test_cpu_checks_for_gpu_multi.py. Each test skips, with the reason,
unless torch sees enough CUDA devices and NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import gpu_multi_cases as gm

pytestmark = pytest.mark.gpu
BACKEND = "cpu:gloo,cuda:nccl"
DTYPES = list(gm.DTYPES)


def _need(ranks: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} CUDA devices (NCCL: one rank per GPU); "
                    f"torch sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL (torch.distributed.is_nccl_available() is False)")


def _launch(ranks: int, paths: list[str]) -> dict:
    from moeflow.launch import launch_local

    return launch_local(gm.worker, ranks, "cuda", DTYPES, paths, backend=BACKEND,
                        timeout_s=300)


@pytest.fixture(scope="module")
def two_gpus():
    _need(2)
    return _launch(2, list(gm.WORKERS))


def test_parm_s1_s2_saa_s2_aas_on_two_gpus(two_gpus):
    done = gm.check(two_gpus, 2, ("parm",), device="cuda")
    assert len(done) == len(gm.PARM_SCHEDULES) * len(gm.PARM_CASES) * len(DTYPES) * 2


def test_fssdp_skewed_placement_on_two_gpus(two_gpus):
    done = gm.check(two_gpus, 2, ("fssdp",), device="cuda")
    assert len(done) == len(gm.FSSDP_CASES) * len(DTYPES) * 2


def test_tensor_parallel_gpt_step_mp2_on_two_gpus(two_gpus):
    done = gm.check(two_gpus, 2, ("gpt",), device="cuda")
    assert len(done) == len(DTYPES) * 2


def test_parm_with_expert_shards_on_four_gpus():
    _need(4)
    got = _launch(4, ["parm"])
    assert got[0]["parm", "float32"]["shard"][1] == 2
    done = gm.check(got, 4, ("parm",), device="cuda")
    assert len(done) == len(gm.PARM_SCHEDULES) * len(gm.PARM_CASES) * len(DTYPES) * 4
