"""Shared experts (DeepSeek-V3, Qwen2-MoE): the function, the task S beside the all-to-all in
the timeline, no host syncs, codecs, config errors. Layout parity on 1, 2 and 4 ranks is in
tests/multirank/test_layer_parity.py (cases ``shared_*``), every algorithm x schedule in
tests/multirank/test_schedule_parity.py, Parm's ESP in tests/helpers/parm_cases.py."""

from __future__ import annotations

import time

import pytest
import torch

import moeflow as mf
from moeflow.launch import launch_local
from moeflow.schedule.executor import Timeline
from tests.helpers import host_sync

BASE = dict(d_model=8, d_expert=12, num_experts=4, top_k=2)


def _pair(**kw):
    """A layer with shared experts and the same layer without them (same routed weights)."""
    cfg = mf.MoEConfig(**BASE, **kw)
    layer = mf.MoELayer(cfg).double()
    ref = mf.MoELayer(cfg.replace(num_shared_experts=0, shared_expert_hidden=None,
                                  shared_expert_gate=False)).double()
    ref.load_state_dict({k: v for k, v in layer.state_dict().items()
                         if not k.startswith("shared.")})
    return layer, ref


def _shared_by_hand(layer, x):
    """DeepSeek-V3 Eq. 12's sum over shared experts, one FFN per expert, Qwen2-MoE's gate."""
    s, n = layer.shared, layer.cfg.num_shared_experts
    h = s.hidden // n
    y = 0
    for j in range(n):
        cols = slice(j * h, (j + 1) * h)
        a = x @ s.w1[:, cols]
        if s.b1 is not None:
            a = a + s.b1[cols]
        if s.w3 is not None:
            up = x @ s.w3[:, cols] + (0 if s.b3 is None else s.b3[cols])
            a = torch.nn.functional.silu(a) * up
        else:
            a = torch.nn.functional.gelu(a)
        y = y + a @ s.w2[cols]
    if s.b2 is not None:
        y = y + s.b2
    if s.gate is not None:
        y = torch.sigmoid(x @ s.gate).unsqueeze(-1) * y
    return y


@pytest.mark.parametrize("schedule,r", [("sequential", 1), ("pipelined", 2), ("optsche", 2),
                                        ("optsche", 4)])
@pytest.mark.parametrize("kw", [
    dict(num_shared_experts=2, shared_expert_hidden=6, activation="swiglu", expert_bias=True,
         capacity_factor=None),
    dict(num_shared_experts=1, shared_expert_gate=True, capacity_factor=1.0),
], ids=["two_swiglu_bias_dropless", "gated_gelu_capacity"])
def test_output_and_gradients_are_routed_plus_shared(kw, schedule, r):
    layer, ref = _pair(**kw, schedule=schedule, pipeline_degree=r)
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    y_ref = ref(x) + _shared_by_hand(layer, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-13)
    g = torch.randn_like(y)
    names = [n for n, _ in layer.named_parameters()]
    got = torch.autograd.grad(y, [x] + [p for _, p in layer.named_parameters()], g)
    ref_params = dict(ref.named_parameters(), **{f"shared.{n}": p for n, p in
                                                 layer.shared.named_parameters()})
    want = torch.autograd.grad(y_ref, [x] + [ref_params[n] for n in names], g)
    for name, a, b in zip(["x"] + names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=name)
    with torch.no_grad():                         # eval path: no graph, same function
        torch.testing.assert_close(layer(x), y.detach(), rtol=1e-12, atol=1e-13)


def test_timeline_has_task_s_on_the_compute_lane_in_both_passes():
    layer, _ = _pair(num_shared_experts=1, schedule="optsche", pipeline_degree=2)
    layer.timeline = Timeline()
    layer(torch.randn(6, 8, dtype=torch.float64)).sum().backward()
    recs = [r for r in layer.timeline.records if r.task.kind == "S"]
    assert [(r.phase, r.lane) for r in recs] == [("forward", "compute"),
                                                 ("backward", "compute")]


DELAY_S = 0.15


def overlap_worker(schedule: str) -> list[tuple]:
    """Rank 1 compresses each chunk DELAY_S late (a codec registered here, in the spawned
    ranks only), so each all-to-all of rank 0 is in flight for at least that long; rank 0's
    timeline shows what its computing lane did meanwhile."""
    from moeflow.comm.codecs import CODECS, register_codec
    from moeflow.comm.codecs.none import NoCodec

    topo = mf.Topology.from_env()
    if "test_late_on_rank1" not in CODECS:
        @register_codec("test_late_on_rank1")
        class LateOnRank1(NoCodec):
            def encode(self, x):
                if topo.rank == 1:
                    time.sleep(DELAY_S)
                return super().encode(x)

    cfg = mf.MoEConfig(**BASE, capacity_factor=1.0, num_shared_experts=1,
                       shared_expert_gate=True, schedule=schedule, pipeline_degree=2,
                       codec="test_late_on_rank1", codec_backward=True)
    layer = mf.MoELayer(cfg, topo)
    layer.timeline = Timeline()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(topo.rank))
    layer(x).square().sum().backward()
    return [(r.task.kind, r.task.chunk, r.phase, r.lane, r.start, r.end)
            for r in layer.timeline.records]


@pytest.mark.multirank
def test_shared_task_overlaps_the_dispatch_all_to_all():
    recs = launch_local(overlap_worker, 2, "optsche", timeout_s=120)[0]
    for phase in ("forward", "backward"):
        def one(kind):
            (rec,) = [r for r in recs if r[0] == kind and r[2] == phase and r[1] == 0]
            return rec

        s, c1, a1, d1 = one("S"), one("C1"), one("A1"), one("D1")
        assert s[3] == "compute" and a1[3] == "comm"
        assert a1[5] - a1[4] >= DELAY_S * 0.5, (phase, a1)      # the wait is real
        # S ran while A1^1 was outstanding: after C1^1 issued it, before it completed (when
        # the lane thread starts it is up to the OS: on CPU S may begin first), and the
        # computing lane waited for A1^1 only after S (D1^1 consumes it)
        assert c1[5] <= s[4] and s[5] <= a1[5] <= d1[4], (phase, c1, s, a1, d1)


def test_no_host_syncs_added():
    """Padded capacity mode stays at zero syncs and dropless at one with shared experts (one
    process; a lossless and a lossy codec, the sequential and an overlapping schedule).
    Padded: the GPU default; "auto" trims on CPU, one read of the kept counts
    (tests/multirank/test_host_sync.py)."""
    x = torch.randn(12, 16, requires_grad=True)
    for codec in ("none", "int8"):
        for schedule, r in (("sequential", 1), ("optsche", 2)):
            for cf in (1.25, None):
                cfg = mf.MoEConfig(d_model=16, d_expert=32, num_experts=4, top_k=2, seed=1,
                                   codec=codec, schedule=schedule, pipeline_degree=r,
                                   capacity_factor=cf, num_shared_experts=2,
                                   shared_expert_gate=True, activation="swiglu",
                                   capacity_padding="pad")
                layer = mf.MoELayer(cfg)
                host_sync.step_syncs(layer, x)
                syncs = host_sync.step_syncs(layer, x)
                assert sum(syncs.values()) == (0 if cf else 1), (codec, schedule, cf, syncs)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_shared_output_is_not_encoded(codec):
    """A lossy codec changes only the routed part: shared experts never cross the wire."""
    layer, ref = _pair(num_shared_experts=1, capacity_factor=None, codec=codec)
    x = torch.randn(10, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x) - ref(x), _shared_by_hand(layer, x), rtol=1e-12,
                               atol=1e-13)


@pytest.mark.parametrize("kw,match", [
    (dict(num_shared_experts=-1), "num_shared_experts=-1"),
    (dict(shared_expert_hidden=8), "no shared experts"),
    (dict(shared_expert_gate=True), "no shared experts"),
    (dict(num_shared_experts=1, shared_expert_hidden=0), "shared_expert_hidden=0"),
    (dict(num_shared_experts=1, shared_expert_gate=1), "shared_expert_gate=1"),
])
def test_config_errors(kw, match):
    with pytest.raises(mf.ConfigError, match=match):
        mf.MoEConfig(**BASE, **kw)


def test_layout_independent_init_and_parameter_count():
    cfg = mf.MoEConfig(**BASE, num_shared_experts=3, shared_expert_hidden=5,
                       activation="swiglu", shared_expert_gate=True)
    a, b = mf.MoELayer(cfg), mf.MoELayer(cfg)
    for (n, p), (_, q) in zip(a.shared.named_parameters(), b.shared.named_parameters()):
        assert torch.equal(p, q), n
    assert a.shared.w1.shape == (8, 15) and a.shared.w2.shape == (15, 8)
    assert sum(p.numel() for p in a.shared.parameters()) == 3 * 8 * 15 + 8


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["capacity", "dropless"])
def test_shared_task_on_one_gpu(capacity_factor):
    """On CUDA: task S on the compute stream, the same function as the sequential schedule,
    and no host sync added (capacity: none; dropless: the counts only)."""
    cfg = mf.MoEConfig(d_model=64, d_expert=128, num_experts=4, top_k=2,
                       capacity_factor=capacity_factor, num_shared_experts=2,
                       shared_expert_gate=True, activation="swiglu", schedule="optsche",
                       pipeline_degree=2)
    layer = mf.MoELayer(cfg).cuda()
    ref = mf.MoELayer(cfg.replace(schedule="sequential")).cuda()
    x = torch.randn(300, 64, device="cuda")
    layer.timeline = Timeline()
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-6, atol=1e-7)
    assert {r.lane for r in layer.timeline.records if r.task.kind == "S"} == {"compute"}
    xs = x.detach().requires_grad_()
    host_sync.step_syncs(layer, xs)
    syncs = host_sync.step_syncs(layer, xs)
    assert sum(syncs.values()) == (0 if capacity_factor else 1), syncs
