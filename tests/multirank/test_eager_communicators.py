"""Communicators formed when the topology is built, and the lane's point-to-point on a group of
its own (docs/gpu.md, "CUDA-path review", finding 7).

NCCL forms a communicator at a group's first operation unless the process group is bound to a
device; a rank whose first batched point-to-point on a group is empty issues nothing and leaves
its peers waiting there. ``moeflow.launch.init_from_env`` binds the device (``device_id``), and
``Topology`` warms every group with one all-reduce where nothing is bound, in one order on
every rank. HECATE's early spAG (Section 3.2, Fig. 1c) runs its batched point-to-point on the
lane thread while the caller runs the block's attention; a batch's coalescing state belongs to
its process group, so the spAG runs on ``topo.lane_group``, not the world group the caller's
code may use. NCCL itself is not on the CPU machine: the device binding is checked with a
recorded ``init_process_group``, the warm-up order on 4 gloo ranks (where a cross order would
hang: gloo's all-reduce blocks), the spAG's group on 4 gloo ranks.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
import torch.distributed as dist

from moeflow import launch, topology
from moeflow.launch import launch_local

WORLD = 4


def _record_init(monkeypatch) -> dict:
    seen: dict = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.update(set_device=d))
    monkeypatch.setenv("LOCAL_RANK", "3")
    return seen


def test_init_from_env_binds_the_device_with_nccl(monkeypatch):
    seen = _record_init(monkeypatch)
    launch.init_from_env(30.0, "cpu:gloo,cuda:nccl")
    assert seen["device_id"] == torch.device("cuda", 3) and seen["set_device"] == 3
    assert seen["backend"] == "cpu:gloo,cuda:nccl"


def test_init_from_env_binds_nothing_on_gloo(monkeypatch):
    seen = _record_init(monkeypatch)
    launch.init_from_env(30.0, "gloo")
    assert "device_id" not in seen and "set_device" not in seen


@pytest.mark.parametrize("config, bound, want", [
    ("cpu:gloo,cuda:nccl", None, torch.device("cuda", 1)),   # NCCL, no device bound: warm up
    ("cpu:gloo,cuda:nccl", torch.device("cuda", 1), None),   # bound: torch formed them
    ("gloo", None, None),                                    # gloo connects at creation
])
def test_eager_device_only_where_nccl_is_lazy(monkeypatch, config, bound, want):
    world = types.SimpleNamespace(bound_device_id=bound)
    monkeypatch.setattr(topology, "group_backend", lambda group=None: config)
    monkeypatch.setattr(topology, "dist", types.SimpleNamespace(
        group=types.SimpleNamespace(WORLD=world)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert topology.eager_device() == want


def _warm_order(topo) -> list[str]:
    names, real = [], dist.all_reduce

    def recording(tensor, *a, group=None, **k):
        names.append(group.group_name)
        return real(tensor, *a, group=group, **k)
    dist.all_reduce = recording
    try:
        n = topology.connect_eagerly(topo, torch.device("cpu"))   # as on NCCL, on gloo
    finally:
        dist.all_reduce = real
    assert n == len(names)
    return names


def _lane_spag(topo) -> list[tuple[str, bool, bool]]:
    """(thread, on the lane group, on the world group) of every point-to-point batch of an
    FSSDP layer's step with the early spAG."""
    from tests.helpers import parity
    from tests.helpers.collective_order_worker import HOLDERS
    layer = parity.make_layer("capacity_k2", topo, placement="fssdp",
                              fssdp=dict(materialize="manual", early_gather=True))
    layer.experts.set_holders(HOLDERS)
    seen, real = [], dist.batch_isend_irecv

    def recording(ops):
        g = ops[0].group
        seen.append((threading.current_thread().name, g is topo.lane_group,
                     g is topo.world_group))
        return real(ops)
    dist.batch_isend_irecv = recording
    try:
        x, _ = parity.make_batch("capacity_k2", topo.rank)
        layer.prefetch()
        layer(x).sum().backward()
    finally:
        dist.batch_isend_irecv = real
    layer.lane.close()
    return seen


def worker() -> dict:
    ep = topology.Topology.from_env(ep_size=2, local_size=2)
    parm = topology.Topology.from_env(ep_size=1, local_size=2, mp_size=2, esp_size=2)
    out = {"lazy_on_gloo": (topology.connect_eagerly(ep), topology.connect_eagerly(parm))}
    for name, topo in (("ep", ep), ("parm", parm)):
        out[name] = (_warm_order(topo), [g.group_name for g in topo.groups()])
    out["spag"] = _lane_spag(topology.Topology.from_env(local_size=2))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return launch_local(worker, WORLD, timeout_s=240, threads=1)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["ep", "parm"])
def test_every_group_is_warmed_once_in_one_order(results, layout):
    for rank, got in results.items():
        warmed, groups = got[layout]
        assert got["lazy_on_gloo"] == (0, 0), rank        # nothing to warm on gloo
        assert warmed == groups and len(set(warmed)) == len(warmed), rank
        assert len(warmed) >= (6 if layout == "ep" else 8), (rank, warmed)
    for a in results:                                       # shared groups: the same order
        for b in results:
            wa, wb = results[a][layout][0], results[b][layout][0]
            shared = [n for n in wa if n in wb]
            assert shared == [n for n in wb if n in wa], (layout, a, b, wa, wb)


@pytest.mark.multirank
def test_the_lane_spag_runs_on_the_lane_group(results):
    for rank, got in results.items():
        lane = [s for s in got["spag"] if s[0].startswith("moeflow-comm")]
        assert lane, (rank, got["spag"])
        assert all(on_lane and not on_world for _t, on_lane, on_world in lane), (rank, lane)
        # the computing thread's point-to-point (the backward's spRS) stays on the world group
        rest = [s for s in got["spag"] if not s[0].startswith("moeflow-comm")]
        assert rest and all(on_world for _t, _l, on_world in rest), (rank, rest)
