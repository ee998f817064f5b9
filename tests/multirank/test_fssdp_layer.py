"""MoELayer(placement="fssdp") (HECATE Section 3.2 / 4.4 in the layer): float64 parity of
FSSDP = EP = one process over several AdamW steps, on 2 nodes x 2 ranks, with static, random
and skewed materialized placements, capacity and dropless, re-materialization and a pipelined
schedule; one optimizer-state entry per rank (its slot tensor); refusals."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoEConfig, MoELayer, Topology
from moeflow.errors import ConfigError
from moeflow.launch import launch_local
from tests.helpers import fssdp_layer_worker as w
from tests.helpers import parity

TOL = dict(rtol=1e-9, atol=1e-12)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One 4-rank launch for the whole module; each rank's results keyed by part."""
    ckpt = str(tmp_path_factory.mktemp("fssdp") / "ckpt")
    resh = str(tmp_path_factory.mktemp("reshard") / "ckpt")
    return ckpt, launch_local(w.all_worker, w.WORLD, ckpt, resh, timeout_s=240)


def _part(launched, name):
    return {r: got[name] for r, got in launched[1].items()}


@pytest.fixture(scope="module")
def results(launched):
    return _part(launched, "layer")


@pytest.fixture(scope="module")
def references():
    return {c: w.reference(c) for c in w.CASES}


def _check(got: dict, ref: dict, rank: int, label: str) -> None:
    torch.testing.assert_close(got["y"], ref["y"][rank], **TOL, msg=lambda m: f"y {label}: {m}")
    torch.testing.assert_close(got["x_grad"], w.WORLD * ref["x_grad"][rank], **TOL,
                               msg=lambda m: f"x_grad {label}: {m}")
    for kind in ("grads", "params", "dense_grads", "dense_params"):
        for key, value in got[kind].items():
            torch.testing.assert_close(value, ref[kind][key], **TOL,
                                       msg=lambda m: f"{kind} {key} {label}: {m}")


@pytest.mark.multirank
@pytest.mark.parametrize("case,variant", w.pairs())
def test_matches_reference_over_adamw_steps(results, references, case, variant):
    for step in range(w.STEPS):
        seen = set()
        for rank in range(w.WORLD):
            got = results[rank][case, variant][step]
            _check(got, references[case][step], rank, f"{case}/{variant} step {step} rank {rank}")
            seen |= {e for e, _ in got["grads"]}
        assert seen == set(range(8))          # every expert stored (and compared) somewhere


@pytest.mark.multirank
@pytest.mark.parametrize("variant", [v for v in w.VARIANTS if v != "ep"])
def test_one_copy_of_each_expert_and_its_state(results, variant):
    for rank in range(w.WORLD):
        got = results[rank]["hot_expert_dropless", variant][-1]
        assert sorted({e for e, _ in got["params"]}) == [2 * rank, 2 * rank + 1]
    ep = results[0]["hot_expert_dropless", "ep"][-1]
    assert "states" not in ep


@pytest.mark.multirank
@pytest.mark.parametrize("variant", ["fssdp_sparse", "fssdp_sparse_cal_rm",
                                     "fssdp_sparse_budget"])
def test_algorithm1_gives_every_rank_the_same_plan(results, variant):
    for case in w.CASES:
        if (case, variant) not in w.pairs():
            continue
        for step in range(w.STEPS):
            plans = [results[r][case, variant][step]["holders"] for r in range(w.WORLD)]
            assert all(p == plans[0] for p in plans)
    # from the second step on, the window's hot experts are replicated
    plans = results[0]["hot_expert_dropless", variant][1]["holders"]
    assert len(plans[5]) > 1


@pytest.mark.multirank
@pytest.mark.parametrize("case", w.FULL_CASES)
def test_memory_budget_sets_m_and_runs_the_slots_by_load_branch(results, case):
    """m from the ranks' byte budgets (1, 3, 2, 1 extra experts): every rank agrees on the
    least, so t = 3 > m = 1 and Algorithm 1 takes lines 6-11 on the real layer; each rank then
    holds at most one expert it does not own (calibration included), and the parity with one
    process is test_matches_reference_over_adamw_steps's fssdp_sparse_budget rows."""
    for step in range(w.STEPS):
        recs = [results[r][case, "fssdp_sparse_budget"][step] for r in range(w.WORLD)]
        assert [g["m"] for g in recs] == [1] * w.WORLD
        if step == 0:                   # no load window yet: P' = P
            assert all(g["branch"] is None for g in recs)
            continue
        assert all(g["branch"] == "slots_by_load" for g in recs)
        holders = recs[0]["holders"]
        for d in range(w.WORLD):
            assert sum(d in h and e // 2 != d for e, h in enumerate(holders)) <= 1
        assert sum(len(h) - 1 for h in holders) >= 1      # some expert is replicated


@pytest.mark.multirank
def test_replicas_compute_tokens_and_move_bytes(results):
    """The manual placements really move experts and tokens: spAG bytes > 0, the hot expert's
    replicas flatten the load (max/mean under skew is lower than with P' = P)."""
    skew = [results[r]["hot_expert_dropless", "fssdp_skewed"][0] for r in range(w.WORLD)]
    static = [results[r]["hot_expert_dropless", "fssdp_static"][0] for r in range(w.WORLD)]
    assert sum(s["bytes"]["spag"][0] for s in skew) > 0
    assert sum(s["bytes"]["sprs"][0] for s in skew) == sum(s["bytes"]["spag"][0] for s in skew)
    assert all(s["bytes"]["spag"][0] == 0 for s in static)
    ratio = skew[0]["stats"]["fssdp_load_max_over_mean"]
    assert ratio < static[0]["stats"]["fssdp_load_max_over_mean"]
    rm = [results[r]["hot_expert_dropless", "fssdp_skewed_rm"][0] for r in range(w.WORLD)]
    assert all(s["bytes"]["spag_backward"] == s["bytes"]["spag"] for s in rm)


def test_refusals():
    with pytest.raises(ConfigError, match="placement"):
        parity.make_config("dropless_k2", placement="zero")
    with pytest.raises(ConfigError, match="need placement='fssdp'"):
        parity.make_config("dropless_k2", fssdp=dict(rematerialize=True))
    with pytest.raises(ConfigError, match="unknown options"):
        parity.make_config("dropless_k2", placement="fssdp", fssdp=dict(remat=True))
    with pytest.raises(ConfigError, match="materialize"):
        parity.make_config("dropless_k2", placement="fssdp", fssdp=dict(materialize="x"))
    layer = MoELayer(parity.make_config("dropless_k2", placement="fssdp",
                                        fssdp=dict(materialize="manual")), Topology.single())
    with pytest.raises(ConfigError, match="set_holders"):
        layer(torch.zeros(3, parity.D_MODEL))
    with pytest.raises(ConfigError, match="ranks are 0..0"):
        layer.experts.set_holders([{1}] * 8)          # a world of one: rank 1 does not exist
    with pytest.raises(ConfigError, match="must contain the expert's owner"):
        layer.experts.set_holders([{0}] * 7 + [set()])


def test_single_process_fssdp_is_the_dense_layer():
    cfg = MoEConfig(d_model=8, d_expert=12, num_experts=4, top_k=2, seed=3, capacity_factor=1.0)
    a = MoELayer(cfg.replace(placement="fssdp"), Topology.single()).double()
    b = MoELayer(cfg, Topology.single()).double()
    x = torch.randn(10, 8, dtype=torch.float64)
    torch.testing.assert_close(a(x), b(x), **TOL)
    assert [n for n, _ in a.named_parameters()] == ["router.weight", "experts.slots"]
    seen = len(a.experts.window.state_dict()["loads"])
    with torch.no_grad():                       # evaluation: not in Algorithm 1's load window
        a(x)
    assert len(a.experts.window.state_dict()["loads"]) == seen == 1


def test_fssdp_with_a_registered_activation_and_its_options_and_shared_experts():
    """GPT-OSS's clamped SwiGLU (with options) and a shared expert under FSSDP: the same
    function as the dense layer; a custom expert module is refused by name."""
    cfg = MoEConfig(d_model=8, d_expert=12, num_experts=4, top_k=2, seed=3,
                    capacity_factor=None, activation="clamped_swiglu",
                    activation_options={"alpha": 1.5, "limit": 0.5}, expert_bias=True,
                    num_shared_experts=1)
    a = MoELayer(cfg.replace(placement="fssdp"), Topology.single()).double()
    b = MoELayer(cfg, Topology.single()).double()
    x = torch.randn(10, 8, dtype=torch.float64) * 3
    torch.testing.assert_close(a(x), b(x), **TOL)
    with pytest.raises(ConfigError, match="expert_module"):
        MoELayer(cfg.replace(placement="fssdp", expert_module="mine"), Topology.single())


@pytest.fixture(scope="module")
def gpt(launched):
    return _part(launched, "gpt")


@pytest.mark.multirank
@pytest.mark.parametrize("label", ["fssdp", "fssdp_rm"])
def test_gpt_with_early_gather_trains_like_ep(gpt, label):
    for rank in range(w.WORLD):
        ep, fs = gpt[rank]["ep"], gpt[rank][label]
        assert fs["prefetched"] == 3                  # the block's early spAG was pending
        torch.testing.assert_close(torch.tensor(fs["losses"]), torch.tensor(ep["losses"]),
                                   **TOL)
        for key, value in fs["experts"].items():
            torch.testing.assert_close(value, ep["experts"][key], **TOL)
        for key, value in fs["dense"].items():
            torch.testing.assert_close(value, ep["dense"][key], **TOL)


@pytest.fixture(scope="module")
def ckpt(launched):
    return launched[0], _part(launched, "ckpt")


@pytest.mark.multirank
def test_checkpoint_resumes_exactly_and_loads_under_ep_and_one_process(ckpt):
    from moeflow import checkpoint

    path, got = ckpt
    for rank in range(w.WORLD):
        r = got[rank]
        assert r["step"] == 2
        for key, value in r["saved"].items():
            torch.testing.assert_close(r["loaded"][key], value, rtol=0, atol=0)
        assert r["again"] == r["after"]                           # resumed exactly
        torch.testing.assert_close(torch.tensor(r["ep_after"]), torch.tensor(r["after"]), **TOL)
        for key, value in r["final"].items():
            torch.testing.assert_close(r["final_resumed"][key], value, rtol=0, atol=0)
            torch.testing.assert_close(r["final_ep"][key], value, **TOL)
    # one process (world 1) loads every expert, each saved once by its owner
    one = w.small_gpt(Topology.single(), placement="fssdp")
    opt = torch.optim.AdamW(one.parameters(), lr=0.01)
    assert checkpoint.load(path, one, opt) == 2
    mine = w.all_experts(one)
    saved = {k: v for rank in range(w.WORLD) for k, v in got[rank]["saved"].items()}
    assert sorted(mine) == sorted(saved)
    for key, value in saved.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=0)
    state = opt.state[one.blocks[0].ffn.experts.slots]
    assert float(state["step"]) == 2 and state["exp_avg"].abs().sum() > 0


def test_cli_overrides_and_metrics():
    from moeflow.commands.common import parse_overrides
    from moeflow.config import ModelConfig
    from moeflow.strategies.fssdp.metrics import fssdp_metrics
    from moeflow.strategies.fssdp.options import FSSDPOptions

    over = parse_overrides(["moe.placement=fssdp",
                            'moe.fssdp={"materialize": "sparse", "overlap_degree": 2}'],
                           ModelConfig)
    cfg = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                      moe=dict(num_experts=4, d_expert=8, **over["moe"]))
    moe = cfg.moe_config(1)
    assert moe.placement == "fssdp" and moe.fssdp == FSSDPOptions(materialize="sparse",
                                                                  overlap_degree=2)
    model = w.small_gpt(Topology.single(), placement="fssdp")
    assert fssdp_metrics(model) == {}
    model(torch.randint(0, 32, (2, 8)))
    got = fssdp_metrics(model)
    assert got["fssdp_rank_tokens"] == [2 * 2 * 8 * 2]          # 2 layers x 32 choices
    assert got["fssdp_max_over_mean"] == 1.0 and got["spag_bytes"] == 0.0


@pytest.fixture(scope="module")
def resharded(launched):
    return _part(launched, "reshard")


@pytest.mark.multirank
@pytest.mark.parametrize("label", ["static", "sparse"])
def test_training_continues_identically_across_a_reshard(resharded, label):
    ep_all = {k: v for r in range(w.WORLD) for k, v in resharded[r]["ep"]["experts"].items()}
    seen = set()
    for rank in range(w.WORLD):
        ep, fs = resharded[rank]["ep"], resharded[rank][label]
        torch.testing.assert_close(torch.tensor(fs["losses"]), torch.tensor(ep["losses"]),
                                   **TOL)
        for key, value in fs["experts"].items():          # wherever the expert lives now
            torch.testing.assert_close(value, ep_all[key], **TOL)
        seen |= set(fs["experts"])
        assert fs["states"] == 1          # one slot tensor for both layers, one state entry
    assert seen == set(ep_all)            # each expert stored exactly once, all present
    owners = resharded[0][label]["owners"]
    assert len(owners) == 2                                      # after steps 2 and 4
    even = [[e // 2 for e in range(8)]] * 2
    assert any(o != even for o in owners)                         # experts really moved
    for o in owners:                                             # memory stays balanced
        flat = [r for layer in o for r in layer]
        assert [flat.count(r) for r in range(w.WORLD)] == [4] * w.WORLD
    assert all(resharded[r][label]["owners"] == owners for r in range(w.WORLD))
    got = resharded[0][label]["metrics"]
    assert got["spag_bytes"] == got["sprs_bytes"] and sum(got["fssdp_rank_tokens"]) > 0


@pytest.mark.multirank
def test_checkpoint_after_a_reshard_resumes_exactly(resharded):
    for rank in range(w.WORLD):
        fs = resharded[rank]["sparse"]
        assert fs["resumed_owners"] == fs["owners"][0]           # the re-sharded map
        assert fs["resumed_loss"] == fs["losses"][3:]            # bitwise
    # every expert after step 4, wherever it lives now, equals the resumed run's
    final = {k: v for r in range(w.WORLD) for k, v in resharded[r]["sparse"]["experts"].items()}
    again = {k: v for r in range(w.WORLD)
             for k, v in resharded[r]["sparse"]["resumed_experts"].items()}
    assert sorted(final) == sorted(again) and len(final) == 2 * 8 * 2
    for key, value in final.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0)


@pytest.fixture(scope="module")
def composed(launched):
    return _part(launched, "compose")


@pytest.mark.multirank
@pytest.mark.parametrize("label", list(w.COMPOSE))
def test_composes_with_codecs_algorithms_schedulers_bigmac_smile(composed, label):
    """FSSDP with replicas computes what EP computes under the same codec / all-to-all /
    schedule / structure / router (a lossy codec's error is elementwise, so the same)."""
    tol = dict(rtol=1e-6, atol=1e-6) if "int8" in label else TOL
    ep_grads = {k: v for r in range(w.WORLD) for k, v in composed[r][label, "ep"]["grads"].items()}
    for rank in range(w.WORLD):
        ep, fs = composed[rank][label, "ep"], composed[rank][label, "fssdp"]
        torch.testing.assert_close(fs["y"], ep["y"], **tol)
        torch.testing.assert_close(fs["x_grad"], ep["x_grad"], **tol)
        for key, value in fs["grads"].items():
            torch.testing.assert_close(value, ep_grads[key], **tol)
        for key, value in fs["dense_grads"].items():
            torch.testing.assert_close(value, ep["dense_grads"][key], **tol)


@pytest.mark.multirank
def test_bench_memory_probe_sees_rematerialization_free_the_held_experts(launched):
    """moeflow bench hecate's probe (benchmarks/hecate/hecate_memory.py) on 4 ranks: without RM
    the held experts stay between forward and backward, with RM their storage is 0 there and
    refilled by the backward; the gradients are the same."""
    for rank, got in _part(launched, "memory").items():
        plain, rm = got[False], got[True]
        held = sum(rank in h for h in w.SKEWED[0])
        assert plain["rows"] == rm["rows"] == held
        assert plain["held"] == held * plain["expert_bytes"] > 0
        assert rm["held"] == 0 and rm["after_backward"] == rm["rows"] * rm["expert_bytes"]
        torch.testing.assert_close(rm["grad"], plain["grad"], rtol=0, atol=0)


@pytest.mark.multirank
@pytest.mark.slow      # the default run checks every variant on 4 ranks (2 nodes x 2)
def test_eight_ranks_match_the_reference():
    """8 ranks as 4 nodes x 2: EP, static FSSDP and Algorithm 1 (with calibration and RM)."""
    w.check_eight_ranks()
