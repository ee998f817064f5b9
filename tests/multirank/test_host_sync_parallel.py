"""The hot path's host-sync contract on the parallel paths beside EP (one 4-rank gloo spawn,
2 nodes x 2): a forward + backward of Parm's S1, S2-SAA and S2-AAS at (N_MP, N_EP, N_ESP) =
(2, 1, 2), of Parm's baseline with ESP peers holding different tokens at (1, 2, 2),
of the shared-expert layers, and of HECATE's FSSDP placement (static, skewed P',
Algorithm 1 with re-materialization), counted by :mod:`moeflow.bench.syncs` (this thread and
the comm lane).

Measured (every rank): Parm S1 / S2-SAA / S2-AAS, the baseline with ESP, and shared experts
keep EP's contract, padded capacity 0 syncs and dropless 1 (``Tensor.tolist``: learning the
row counts). FSSDP makes 1 sync in capacity mode too: see ``FSSDP_SYNCS``.
"""

from __future__ import annotations

import pytest

from moeflow.launch import launch_local
from tests.helpers import host_sync_parallel as cases

pytestmark = pytest.mark.multirank

EP_CONTRACT = {"capacity": {}, "dropless": {"Tensor.tolist": 1}}
#: FSSDP reads every rank's per-expert counts on the host in capacity mode too, once per layer
#: call: ``moeflow/strategies/fssdp/token_plan.py`` ``KeptChoices`` -> ``comm/exchange.py``
#: ``gather_device_counts`` -> ``to_host`` (``Tensor.tolist``). HECATE's dispatch rule (Sec.
#: 4.4, ``strategies/fssdp/topology_dispatch.py``) splits each (source, expert) block over the expert's holders
#: from those counts, on the host, and the all-to-all's split sizes come from that plan, so the
#: sync is inherent (docs/hecate.md "Costs to know", docs/gpu.md). It replaces the dropless
#: sync of EP (one, not two).
FSSDP_SYNCS = {"capacity": {"Tensor.tolist": 1}, "dropless": {"Tensor.tolist": 1}}


@pytest.fixture(scope="module")
def results():
    return launch_local(cases.worker, cases.WORLD, timeout_s=300)


def test_every_case_ran_on_every_rank(results):
    want = {(path, mode) for path, mode, *_ in cases.cases()}
    assert len(want) == 16
    for rank in range(cases.WORLD):
        assert set(results[rank]) == want, rank


@pytest.mark.parametrize("path", list(cases.PARM) + list(cases.BASELINE) + list(cases.SHARED))
def test_parm_and_shared_experts_keep_the_ep_contract(results, path):
    for rank in range(cases.WORLD):
        for (p, mode), got in results[rank].items():
            if p == path:
                assert got == EP_CONTRACT[mode], (rank, path, mode, got)


@pytest.mark.parametrize("path", list(cases.FSSDP))
def test_fssdp_syncs_exactly_once(results, path):
    for rank in range(cases.WORLD):
        for mode in ("capacity", "dropless"):
            got = results[rank][path, mode]
            assert got == FSSDP_SYNCS[mode], (rank, path, mode, got)
