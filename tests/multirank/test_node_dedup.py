"""``a2a="node_dedup"``: the node-deduplicated dispatch and combine equal the one-process
float64 reference (outputs, input gradients, router and expert gradients, parameters after an
SGD step; the reference ``direct`` is tested against in test_layer_parity.py) on 4 gloo ranks
as 2 emulated nodes x 2 and on 8 ranks as 4 x 2, dropless and with capacity, pipelined
(r > 1, each scheduler), and what it does not run with yet is refused with a ConfigError."""

from __future__ import annotations

import pytest

import moeflow as mf
from moeflow.config import ConfigError
from moeflow.launch import launch_local
from tests.helpers import node_dedup_cases, parity

# dropless: top-2, all experts, a hot expert, DeepSeek-V3 group-limited routing, shared
# experts with node-limited routing (topk_group=1: both choices on one node), BigMac, GPT-OSS;
# capacity: tight drops, a hot expert, gated shared experts, a rank with no tokens, BigMac,
# per-call top_k / capacity_factor overrides (capacity and dropless); SMILE's bi-level
# router (top-4 as 2 nodes x 2 experts: each token's choices repeat its nodes)
NAMES = ["dropless_k2", "dropless_k_eq_E", "hot_expert_dropless", "deepseek_v3_groups",
         "shared_deepseek_v3", "bigmac_k8", "gpt_oss_pieces",
         "capacity_k2", "capacity_k1_tight", "hot_expert_capacity", "shared_gated_capacity",
         "zero_token_rank", "bigmac_swiglu_capacity", "call_top3_capacity2",
         "call_dropless_top1", "bilevel_top1", "bilevel_dropless_2x2"]


@pytest.fixture(scope="module")
def results_2x2():
    return launch_local(parity.variants_worker, 4, NAMES, [dict(a2a="node_dedup")], 2,
                        timeout_s=300)


@pytest.mark.multirank
@pytest.mark.parametrize("name", NAMES)
def test_node_dedup_matches_reference_2x2(results_2x2, name):
    ref = parity.reference(name, 4)
    for rank, res in results_2x2.items():
        parity.assert_rank_matches(res[(name, 0)], ref, rank, 4, "node_dedup 2x2")


# pipelined: chunks of consecutive tokens, each through the deduplicated exchange, in the
# scheduler's order (OptSche at r = 2 by default; the others, and r = 3, marked slow). The
# cases: dropless, capacity with drops, a rank with no tokens (empty chunks)
PIPE_NAMES = ["dropless_k2", "capacity_k1_tight", "zero_token_rank"]
PIPE_DEFAULT = [dict(a2a="node_dedup", pipeline_degree=2, schedule="optsche")]
PIPE_SLOW = [dict(a2a="node_dedup", pipeline_degree=2, schedule="sequential"),
             dict(a2a="node_dedup", pipeline_degree=3, schedule="pipelined"),
             dict(a2a="node_dedup", pipeline_degree=3, schedule="optsche")]


def _check_pipelined(got: dict, variants: list[dict]) -> None:
    for name in PIPE_NAMES:
        ref = parity.reference(name, 4)
        for i, v in enumerate(variants):
            for rank, res in got.items():
                parity.assert_rank_matches(res[(name, i)], ref, rank, 4, f"node_dedup {v}")


@pytest.mark.multirank
def test_node_dedup_pipelined_optsche_matches_reference():
    from moeflow.schedule import SCHEDULERS
    got = launch_local(node_dedup_cases.pipelined_worker, 4, PIPE_NAMES, PIPE_DEFAULT,
                       timeout_s=300)
    _check_pipelined(got, PIPE_DEFAULT)
    want = [(t.kind, t.chunk) for t in SCHEDULERS["optsche"]().order(2)]
    for res in got.values():        # the computing tasks ran in OptSche's order (Eq. 12)
        assert res["order"] == want, res["order"]


@pytest.mark.multirank
@pytest.mark.slow
def test_node_dedup_pipelined_other_schedulers_match_reference():
    got = launch_local(node_dedup_cases.pipelined_worker, 4, PIPE_NAMES, PIPE_SLOW,
                       timeout_s=600)
    _check_pipelined(got, PIPE_SLOW)


TOKENS_8 = (6, 11, 4, 9, 7, 0, 5, 8)    # 8 ranks' tokens (one rank has none)


def _worker_8(names: list[str]) -> dict:
    parity.TOKENS = TOKENS_8
    return parity.variants_worker(names, [dict(a2a="node_dedup")], 2)


@pytest.mark.multirank
@pytest.mark.slow
def test_node_dedup_matches_reference_4x2(monkeypatch):
    names = ["dropless_k2", "shared_deepseek_v3", "bigmac_k8", "capacity_k2"]
    monkeypatch.setattr(parity, "TOKENS", TOKENS_8)
    got = launch_local(_worker_8, 8, names, timeout_s=300)
    for name in names:
        ref = parity.reference(name, 8)
        for rank, res in got.items():
            parity.assert_rank_matches(res[(name, 0)], ref, rank, 8, "node_dedup 4x2")


TOPO = dict(rank=0, world_size=4, local_size=2, ep_size=4)


@pytest.mark.parametrize("field,value", [("capacity_padding", "pad"), ("codec", "fp16"),
                                         ("schedule", "auto"),
                                         ("placement", "fssdp")])
def test_node_dedup_refuses_what_it_does_not_run_yet(field, value):
    opts = dict(d_model=8, d_expert=8, num_experts=8, top_k=2, capacity_factor=None,
                a2a="node_dedup")
    opts[field] = value
    from moeflow.strategies.node_dedup import check_config
    with pytest.raises(ConfigError, match=f"MoEConfig.{field}=.*node_dedup.*use"):
        check_config(mf.MoEConfig(**opts), mf.Topology(**TOPO))


def test_node_dedup_needs_several_nodes():
    from moeflow.comm.alltoall import ALLTOALLS
    with pytest.raises(ConfigError, match="needs several nodes"):
        ALLTOALLS["node_dedup"](mf.Topology(rank=0, world_size=4, local_size=4, ep_size=4))


def test_auto_does_not_screen_node_dedup():
    from moeflow.autotune.tuner import candidate_algorithms
    cfg = mf.MoEConfig(d_model=8, d_expert=8, num_experts=8, top_k=2, a2a="auto")
    got = candidate_algorithms(cfg, mf.Topology(**TOPO))
    assert "node_dedup" not in got and "direct" in got
