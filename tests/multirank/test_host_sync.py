"""The hot path's contract, for every all-to-all algorithm, codec, schedule and r, on one
process and on 2 gloo ranks as one node and as two nodes:

* host syncs: a forward + backward in capacity mode makes no device-to-host synchronisation;
  dropless makes exactly one (learning the row counts); ``placement="node_dedup"`` none padded,
  one trimmed (``host_sync.sync_budget``). The numpy-based CPU ZFP coders are
  left out (``host_sync.HOST_CODECS``; their CUDA path is in the gpu suite);
* autocast: under bf16 autocast the output has the dtype a dense FFN gives, whatever the codec,
  and the input's gradient keeps the input's dtype.
"""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.launch import launch_local
from tests.helpers import host_sync


def _check(results: dict) -> None:
    assert results
    codecs = set()
    for key, got in results.items():
        case = dict(key)
        codecs.add(case["codec"])
        # a dense FFN gives bf16 under autocast; the layer returns its input's float32
        # (the gated sum in the router's precision, docs/guide.md "Autocast")
        assert got["dense_dtype"] == torch.bfloat16 and got["dtype"] == torch.float32, \
            f"{case}: {got}"
        assert got["grad_dtype"] == torch.float32, f"{case}: {got}"
        if got["syncs"] is None:
            continue
        total = sum(got["syncs"].values())
        want = host_sync.sync_budget(case)
        assert total == want, f"{case}: {got['syncs']} (budget {want})"
    assert {"none", "fp16", "int8", "zfp"} <= codecs


def test_counter_sees_what_would_sync():
    """The counter is not blind: each kind of sync it looks for is counted."""
    x = torch.tensor([0, 2, 1, 2])
    with host_sync.counting() as c:
        x.tolist()
        int(x.sum())
        x[x > 0]
        torch.bincount(x)
        x.nonzero()
        torch.repeat_interleave(x, x)
    assert c.counts["Tensor.tolist"] == 1
    assert c.counts["aten._local_scalar_dense.default"] == 1
    assert c.counts["boolean-mask index"] == 1
    assert c.total >= 5


def test_hot_path_one_process():
    _check(host_sync.hot_path_worker(None))


@pytest.mark.multirank
@pytest.mark.parametrize("local_size", [pytest.param(2, marks=pytest.mark.slow), 1],
                         ids=["one-node", "two-nodes"])
# the default run keeps two nodes: the same cases, with the inter-node stages not empty
def test_hot_path_two_ranks(local_size):
    for results in launch_local(host_sync.hot_path_worker, 2, local_size, timeout_s=300).values():
        _check(results)
        # placement="node_dedup" runs on two nodes only (every codec, r = 1 and 2, padded / trimmed)
        assert any(dict(key).get("placement") == "node_dedup" for key in results) == (local_size == 1)


def test_dropless_sync_is_the_counts():
    layer = mf.MoELayer(mf.MoEConfig(d_model=16, d_expert=32, num_experts=4, top_k=2,
                                     capacity_factor=None))
    x = torch.randn(12, 16)
    host_sync.step_syncs(layer, x)
    assert host_sync.step_syncs(layer, x) == {"Tensor.tolist": 1}


def test_trimmed_capacity_sync_is_the_counts():
    """capacity_padding="trim" learns the kept counts on the host: one sync, like dropless;
    "pad" (what "auto" is on a GPU) none."""
    x = torch.randn(12, 16)
    for padding, want in (("trim", {"Tensor.tolist": 1}),
                          ("pad", {})):
        layer = mf.MoELayer(mf.MoEConfig(d_model=16, d_expert=32, num_experts=4, top_k=2,
                                         capacity_factor=1.25, capacity_padding=padding))
        host_sync.step_syncs(layer, x)
        got = host_sync.step_syncs(layer, x)
        assert {k: v for k, v in got.items() if v} == want

