"""``placement="node_dedup"``: the node-deduplicated dispatch and combine equal the one-process
float64 reference (outputs, input gradients, router and expert gradients, parameters after an
SGD step; the reference ``direct`` is tested against in test_layer_parity.py) on 4 gloo ranks
as 2 emulated nodes x 2 and on 8 ranks as 4 x 2, dropless and with capacity, pipelined
(r > 1, each scheduler), and what it does not run with yet is refused with a ConfigError."""

from __future__ import annotations

import pytest
import torch

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
    return launch_local(parity.variants_worker, 4, NAMES, [dict(placement="node_dedup")], 2,
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
# capacity_padding="pad": fixed splits from the ranks' token counts and capacities (no host
# read); dropless_k2 ignores it
PIPE_DEFAULT = [dict(placement="node_dedup", pipeline_degree=2, schedule="optsche"),
                dict(placement="node_dedup", pipeline_degree=2, schedule="optsche",
                     capacity_padding="pad")]
PIPE_SLOW = [dict(placement="node_dedup", pipeline_degree=2, schedule="sequential"),
             dict(placement="node_dedup", pipeline_degree=3, schedule="pipelined"),
             dict(placement="node_dedup", pipeline_degree=3, schedule="optsche"),
             dict(placement="node_dedup", capacity_padding="pad"),
             dict(placement="node_dedup", pipeline_degree=3, schedule="pipelined",
                  capacity_padding="pad")]


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
    for rank, res in got.items():   # the computing tasks ran in OptSche's order (Eq. 12)
        assert res["order"] == want, res["order"]


@pytest.mark.multirank
@pytest.mark.slow   # the default run: test_collective_order's node_dedup cases (backward hops as lane tasks in schedule order)
def test_node_dedup_backward_hops_overlap_the_experts():
    """The backward is scheduled (moeflow/strategies/node_dedup/backward.py; ScheMoE section
    4): with OptSche at r = 2, a chunk's backward hops (lane) run while the computing lane
    differentiates the other chunk's experts (slowed to SLOW_EXPERTS_S); the sequential
    scheduler runs its hops inline, beside nothing. (The order of the backward's collectives
    is checked in test_collective_order.py.)"""
    got = launch_local(node_dedup_cases.backward_overlap_worker, 4, ["optsche", "sequential"],
                       timeout_s=120)

    def overlaps(recs):
        comm = [t for t in recs if t[2] == "comm"]
        experts = [t for t in recs if t[2] == "compute" and t[0] == "E"]
        assert len(comm) == 4 and len(experts) == 2, recs     # 2 hops and E per chunk
        return [(c[:2], e[:2]) for c in comm for e in experts
                if c[1] != e[1] and c[3] < e[4] and e[3] < c[4]]

    for rank, res in got.items():
        assert overlaps(res["optsche"]), f"rank {rank}: {res['optsche']}"
        assert not overlaps(res["sequential"]), f"rank {rank}: {res['sequential']}"


@pytest.mark.multirank
@pytest.mark.slow
def test_node_dedup_scheduled_backward_with_frozen_parts():
    """The scheduled backward without an input gradient (router frozen, input without grad:
    the way back after E carries nothing) and with frozen experts (no parameter gradients in
    E) gives ``direct``'s gradients of what is not frozen (float64, r = 2, OptSche)."""
    got = launch_local(node_dedup_cases.frozen_worker, 4,
                       ["none", "frozen_router", "frozen_experts"], timeout_s=120)
    for rank, res in got.items():
        grads, x_grad, y = res["none"]
        for mode, want in (("frozen_router", {"experts.w1", "experts.w2"}),
                           ("frozen_experts", {"router.weight"})):
            g2, x2, y2 = res[mode]
            assert set(g2) == want, (rank, mode, set(g2))
            for n in want:
                assert torch.allclose(g2[n], grads[n], rtol=0, atol=1e-12), (rank, mode, n)
            assert (x2 is None) == (mode == "frozen_router"), (rank, mode)
            if x2 is not None:
                assert torch.allclose(x2, x_grad, rtol=0, atol=1e-12), (rank, mode)
            assert torch.allclose(y2, y, rtol=0, atol=1e-12), (rank, mode)


@pytest.mark.multirank
@pytest.mark.slow
def test_node_dedup_pipelined_other_schedulers_match_reference():
    got = launch_local(node_dedup_cases.pipelined_worker, 4, PIPE_NAMES, PIPE_SLOW,
                       timeout_s=600)
    _check_pipelined(got, PIPE_SLOW)


# codecs encode the inter-node hops: the node copy of a token (the gates and ids ride raw in
# the same buffer) and the node's partial sum; with codec_backward, their gradients too.
# "none" is exact (the parity tests above); the lossy ones stay within their error bounds
# (relative to the largest value, three quantisations deep: forward, backward, the step)
CODEC_NAMES = ["dropless_k2", "capacity_k2"]
CODEC_TOL = {"fp16": 2e-3, "bf16": 1.5e-2, "int8": 3e-2}


@pytest.fixture(scope="module")
def codec_results():
    return launch_local(node_dedup_cases.codec_worker, 4, CODEC_NAMES,
                        ["none"] + list(CODEC_TOL), timeout_s=300)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("codec", list(CODEC_TOL))
def test_node_dedup_lossy_codecs_within_bound(codec_results, codec):
    for name in CODEC_NAMES:
        ref = parity.reference(name, 4)
        for rank, res in codec_results.items():
            err = node_dedup_cases.relative_errors(res[(name, codec, "node_dedup")], ref,
                                                   rank, 4)
            assert max(err.values()) < CODEC_TOL[codec], (name, rank, err)
            assert err["y"] > 1e-6, (name, rank, err)          # the codec did run
            exact = node_dedup_cases.relative_errors(res[(name, "none", "node_dedup")], ref,
                                                     rank, 4)
            assert max(exact.values()) < 1e-12, (name, rank, exact)


@pytest.mark.multirank
@pytest.mark.slow
def test_node_dedup_codec_shrinks_only_the_encoded_parts(codec_results):
    """fp16 sends 2 of float64's 8 bytes for each of the M values of a node copy and of a
    partial sum (and of their gradients), and the gates and ids unchanged: per rank, the
    bytes saved are 2 x 6 x M per (token, node) pair sent or relayed."""
    M, saved_pairs = parity.D_MODEL, 0
    for name in CODEC_NAMES:
        for res in codec_results.values():
            raw = res[(name, "none", "node_dedup")]["inter_node_bytes"]
            fp16 = res[(name, "fp16", "node_dedup")]["inter_node_bytes"]
            assert (raw - fp16) % (12 * M) == 0, (name, raw, fp16)
            saved_pairs += (raw - fp16) // (12 * M)
    assert saved_pairs > 0


@pytest.mark.multirank
@pytest.mark.slow
def test_node_dedup_coarse_codecs_err_like_direct():
    """fp8 and zfp (coarse: errors of a few percent to ~15 % on these 8-wide float64 rows)
    against ``direct`` with the same codec: within twice its error (max over ranks)."""
    codecs = ["fp8", "zfp"]
    got = launch_local(node_dedup_cases.codec_worker, 4, CODEC_NAMES, codecs,
                       ("node_dedup", "direct"), timeout_s=600)
    for name in CODEC_NAMES:
        ref = parity.reference(name, 4)
        for codec in codecs:
            err = {a: [node_dedup_cases.relative_errors(res[(name, codec, a)], ref, rank, 4)
                       for rank, res in got.items()] for a in ("node_dedup", "direct")}
            for key in ("y", "x_grad", "params"):
                dedup = max(e[key] for e in err["node_dedup"])
                direct = max(e[key] for e in err["direct"])
                assert 0 < dedup <= 2 * direct, (name, codec, key, dedup, direct)


TOKENS_8 = (6, 11, 4, 9, 7, 0, 5, 8)    # 8 ranks' tokens (one rank has none)


def _worker_8(names: list[str]) -> dict:
    parity.TOKENS = TOKENS_8
    return parity.variants_worker(names, [dict(placement="node_dedup")], 2)


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


@pytest.mark.parametrize("field,value", [("recompute", "moe_act")])
def test_node_dedup_refuses_what_it_does_not_run_yet(field, value):
    opts = dict(d_model=8, d_expert=8, num_experts=8, top_k=2, capacity_factor=None,
                placement="node_dedup")
    opts[field] = value
    from moeflow.strategies.node_dedup.strategy import check_config
    with pytest.raises(ConfigError, match=f"MoEConfig.{field}=.*node_dedup.*use"):
        check_config(mf.MoEConfig(**opts), mf.Topology(**TOPO))


def test_node_dedup_needs_several_nodes():
    from moeflow.strategies import NodeDedup
    with pytest.raises(ConfigError, match="placement='node_dedup' is invalid on 1 node.*"
                                          "needs several nodes"):
        NodeDedup.check_config(mf.MoEConfig(d_model=8, d_expert=8, num_experts=8),
                               mf.Topology(rank=0, world_size=4, local_size=4, ep_size=4))


def test_a2a_node_dedup_names_the_strategy_field():
    with pytest.raises(ConfigError, match="a2a='node_dedup'.*placement='node_dedup'"):
        mf.MoEConfig(d_model=8, d_expert=8, num_experts=8, a2a="node_dedup")


@pytest.mark.multirank
@pytest.mark.slow
def test_tuner_picks_node_dedup_schedule():
    """``placement="node_dedup"`` with schedule and degree "auto": the profiler and the chooser run
    on it (its backward is scheduled and predicted like its forward), every rank
    fixes the same choice, and the step equals the reference."""
    name = "dropless_k2"
    got = launch_local(node_dedup_cases.tuner_worker, 4, name, timeout_s=600)
    ref = parity.reference(name, 4)
    for rank, res in got.items():
        a2a, schedule, r, strategy = res["choice"]
        assert strategy == "node_dedup" and a2a == "direct" and r in (1, 2, 4), res["choice"]
        parity.assert_rank_matches(res, ref, rank, 4, f"node_dedup tuned to {schedule} r={r}")
    assert len({res["choice"] for res in got.values()}) == 1   # every rank alike
