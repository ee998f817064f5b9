"""The multi-GPU suite's rank workers (tests/helpers/gpu_multi_cases.py) run on CPU with gloo, at
float32 and under bf16 autocast, against the same float64 references and tolerances the GPUs
are held to: Parm S1 / S2-SAA / S2-AAS, FSSDP with a skewed P' and the tensor-parallel GPT at
mp = 2 on 2 ranks (one spawn), Parm's 4-rank layout (one more); and the comparison fails on a
wrong result."""

from __future__ import annotations

import copy

import pytest
import torch

from moeflow.launch import launch_local
from tests.helpers import gpu_multi_cases as gm

pytestmark = pytest.mark.multirank
DTYPES = list(gm.DTYPES)


@pytest.fixture(scope="module")
def two_ranks():
    return launch_local(gm.worker, 2, "cpu", DTYPES, list(gm.WORKERS), timeout_s=300)


@pytest.mark.parametrize("path", list(gm.WORKERS))
def test_two_rank_workers_match_the_reference_on_cpu(two_ranks, path):
    done = gm.check(two_ranks, 2, (path,))
    per_rank = {"parm": len(gm.PARM_SCHEDULES) * len(gm.PARM_CASES),
                "fssdp": len(gm.FSSDP_CASES), "gpt": 1}[path]
    assert len(done) == per_rank * len(DTYPES) * 2, done


@pytest.mark.slow      # the 2-rank spawn of the default run checks the same workers
def test_parm_four_rank_layout_matches_the_reference_on_cpu():
    got = launch_local(gm.worker, 4, "cpu", ["float32"], ["parm"], timeout_s=300)
    assert got[0]["parm", "float32"]["shard"][1] == 2          # ESP shards: (2, 1, 2)
    assert len(gm.check(got, 4, ("parm",))) == 4 * 6


def test_the_comparison_catches_wrong_results(two_ranks):
    for path, key, what in (("parm", ("s1", "capacity_k2"), "y"),
                            ("fssdp", "dropless_k2", "x_grad")):
        bad = copy.deepcopy({r: {(path, "bfloat16"): two_ranks[r][path, "bfloat16"]}
                             for r in (0, 1)})
        t = bad[1][path, "bfloat16"][key][what]
        t[0] = -t[0]                                    # one token sent to a wrong expert
        with pytest.raises(AssertionError, match="relative error"):
            gm.check(bad, 2, (path,))
    bad = copy.deepcopy({r: {("gpt", "float32"): two_ranks[r]["gpt", "float32"]}
                         for r in (0, 1)})
    name = next(n for n, w in bad[0]["gpt", "float32"]["locate"].items() if w[0] == "tp")
    bad[0]["gpt", "float32"]["grads"][name] *= 1 + 1e-3     # a 0.1% bug in one TP shard
    with pytest.raises(AssertionError, match="relative error"):
        gm.check(bad, 2, ("gpt",))
    # results from the wrong device are refused
    with pytest.raises(AssertionError):
        gm.check(two_ranks, 2, ("fssdp",), device="cuda")
    assert torch.is_tensor(two_ranks[0]["parm", "float32"]["s2_aas", "dropless_k2"]["y"])
