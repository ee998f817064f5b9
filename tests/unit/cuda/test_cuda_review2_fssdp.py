"""CPU proofs for HECATE's broadcast transport on CUDA (docs/gpu.md, "CUDA-path review, second
read"; HECATE Sections 3.1 and 5): the holder groups' cache is capped at a few NCCL
communicators, and ``transport="auto"`` considers broadcasts only for few, stable holder sets
(no GPU: the backend name and the groups are fakes)."""

from __future__ import annotations

import datetime
import types

import pytest

from moeflow import devices
from moeflow.comm import holder_groups as hg
from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
from moeflow.strategies.fssdp.transport import AUTO_MAX_HOLDER_SETS, broadcast_candidate


@pytest.mark.parametrize("backend, cap", [("cpu:gloo,cuda:nccl", hg.CUDA_MAX_GROUPS),
                                          ("nccl", hg.CUDA_MAX_GROUPS),
                                          ("gloo", hg.DEFAULT_MAX_GROUPS), (None, 256)])
def test_the_cache_is_capped_on_nccl(monkeypatch, backend, cap):
    monkeypatch.setattr(devices, "group_backend", lambda group=None: backend)
    assert hg.default_max_groups(object()) == cap
    assert hg.CUDA_MAX_GROUPS <= 16


def _groups(monkeypatch, max_groups=None, backend="cpu:gloo,cuda:nccl"):
    made = []
    fake = types.SimpleNamespace(get_world_size=lambda group=None: 4,
                                 new_group=lambda ranks, timeout=None: made.append(ranks) or
                                 tuple(ranks),
                                 group=types.SimpleNamespace(WORLD=None))
    monkeypatch.setattr(hg, "dist", fake)
    monkeypatch.setattr(devices, "group_backend", lambda group=None: backend)
    return hg.HolderGroups(None, datetime.timedelta(seconds=5), max_groups=max_groups), made


def test_past_the_cap_nothing_is_created_and_the_error_names_the_fix(monkeypatch):
    groups, made = _groups(monkeypatch)
    assert groups.max_groups == hg.CUDA_MAX_GROUPS
    few = [{0, 1}, {2, 3}, {0}]
    assert groups.fits(few) and groups.missing(few) == [(0, 1), (2, 3)]
    groups.ensure(few)
    assert made == [[0, 1], [2, 3]]
    many = [set(s) for s in [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3), (0, 2), (0, 3),
                              (1, 2), (1, 3), (0, 1, 2, 3)]]
    groups.max_groups = 6
    assert not groups.fits(many)
    with pytest.raises(hg.HolderGroupsError, match="transport='p2p'"):
        groups.ensure(many)
    assert len(made) == 2                       # refused before any world collective


def _placement(*sets):
    return types.SimpleNamespace(holders=[frozenset(s) for s in sets])


def test_auto_considers_broadcast_only_for_few_stable_sets(monkeypatch):
    groups, _ = _groups(monkeypatch)
    few = _placement({0, 1}, {1}, {2, 3}, {3})
    assert broadcast_candidate(few, "manual", groups) is None
    assert "follows the loads" in broadcast_candidate(few, "sparse", groups)
    sets = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3)][:AUTO_MAX_HOLDER_SETS + 1]
    assert "distinct holder sets" in broadcast_candidate(_placement(*sets), "manual", groups)
    groups.max_groups = 1
    assert "max_groups" in broadcast_candidate(few, "manual", groups)
    assert "max_groups" in broadcast_candidate(few, "manual", None)


def test_auto_is_not_timed_when_broadcast_is_no_candidate(monkeypatch):
    groups, _ = _groups(monkeypatch)
    layer = object.__new__(FSSDPExperts)
    layer.options = types.SimpleNamespace(transport="auto", materialize="sparse")
    layer.transport, layer.transport_ms, layer.holder_groups = None, None, groups
    layer.transport_reason = None
    import moeflow.strategies.fssdp.layer_experts as le
    monkeypatch.setattr(le, "time_transports", lambda *a, **k: pytest.fail("timed"))
    assert layer.transport_for(_placement({0, 1}, {1}, {2}, {3})) == ("p2p", None)
    assert "follows the loads" in layer.transport_reason and layer.transport_ms is None


def test_auto_leaves_broadcast_when_a_new_placement_would_pass_the_cap(monkeypatch):
    groups, _ = _groups(monkeypatch, max_groups=2)
    layer = object.__new__(FSSDPExperts)
    layer.options = types.SimpleNamespace(transport="auto", materialize="manual")
    layer.transport, layer.holder_groups, layer.transport_reason = "broadcast", groups, None
    assert layer.transport_for(_placement({0, 1}, {2, 3})) == ("broadcast", groups)
    groups.ensure([{0, 1}, {2, 3}])
    assert layer.transport_for(_placement({0, 2}, {1})) == ("p2p", None)
    assert layer.transport_reason == "holder sets past max_groups"
