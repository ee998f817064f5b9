"""``placement="node_dedup"`` on 2 gloo ranks as 2 nodes x 1 (worker:
tests/helpers/node_dedup_hooks_cases.py).

* Under saved-tensor hooks (non-reentrant checkpoint, ``save_on_cpu``) at ``pipeline_degree``
  2, with an empty chunk on rank 0 only, the backward stays scheduled (one scheduled backward
  per step: the lane's collectives in the scheduler's order on every rank, never in an order
  set by two threads' autograd sequence numbers) and the outputs and gradients equal those
  without hooks, bit for bit in float64.
* Padded mode gathers the ranks' token counts and capacities once per distinct token count
  under ``MoEConfig.equal_rank_tokens`` (every call without it), with equal results; a broken
  promise raises a ConfigError on every rank.
"""

from __future__ import annotations

import pytest
import torch

from moeflow.launch import launch_local
from tests.helpers import node_dedup_hooks_cases as cases

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def hooks_results():
    return launch_local(cases.hooks_worker, 2, timeout_s=300, threads=1)


@pytest.mark.parametrize("case", list(cases.CASES))
@pytest.mark.parametrize("hooks", ["save_on_cpu", "checkpoint"])
def test_scheduled_backward_under_hooks_with_an_empty_chunk_on_one_rank(hooks_results, case,
                                                                        hooks):
    for rank, got in hooks_results.items():
        plain, scheduled = got[case, "none"]
        tensors, n = got[case, hooks]
        assert scheduled == 1 and n == 1, (rank, case, hooks, n)
        assert len(tensors) == len(plain) > 2, (rank, case, hooks)
        for a, b in zip(plain, tensors):
            assert torch.equal(a, b), (rank, case, hooks)


@pytest.mark.slow   # padded node_dedup's parity runs in the default tests/multirank/test_node_dedup.py
def test_padded_gathers_once_per_token_count():
    plain = launch_local(cases.padded_gather_worker, 2, False, timeout_s=300, threads=1)
    promised = launch_local(cases.padded_gather_worker, 2, True, timeout_s=300, threads=1)
    for rank in plain:
        assert plain[rank]["gathers"] == len(cases.SIZES), rank
        assert promised[rank]["gathers"] == len(set(cases.SIZES)), rank
        a, b = plain[rank]["tensors"], promised[rank]["tensors"]
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), rank


def test_padded_broken_promise_raises_on_every_rank():
    got = launch_local(cases.broken_promise_worker, 2, timeout_s=300, threads=1)
    for rank, msg in got.items():
        assert msg.startswith("ConfigError") and "equal_rank_tokens=True" in msg, (rank, msg)
        assert "[6, 4]" in msg, (rank, msg)
