"""Parm stage 2: S1 and S2 with the EP&ESP-AlltoAll, SAA vs AAS, Algorithm 1 (docs/parm.md)."""

from __future__ import annotations

import math

import pytest
import torch

from moeflow import MoEConfig
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.config import ConfigError
from moeflow.launch import launch_local
from moeflow.strategies.parm.algorithm1 import algorithm1
from moeflow.strategies.parm.fits import ParmFits, elements_around
from tests.helpers import parm_cases, parm_sched_cases as cases

WORLD = 4


@pytest.fixture(scope="module")
def results():
    return launch_local(cases.rank_worker, WORLD, list(parm_cases.LAYOUTS), timeout_s=240)


def _reference(schedule: str, name: str, world: int, mp: int) -> dict:
    if schedule == "s1":
        return cases.reference_s1(name, world, mp, **parm_cases.CASES[name])
    return parm_cases.reference(name, world, mp)


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", list(cases.SCHEDULES))
@pytest.mark.parametrize("layout", list(parm_cases.LAYOUTS))
def test_schedule_parity(results, layout, schedule):
    """Outputs, aux loss, input and parameter gradients, clipped norm and parameters after an
    SGD step equal the single-process reference's, every case."""
    mp = parm_cases.LAYOUTS[layout][0]
    for name in cases.schedule_cases(schedule):
        ref = _reference(schedule, name, WORLD, mp)
        for rank in range(WORLD):
            parm_cases.assert_rank_matches(results[rank][(layout, schedule, name)], ref, rank,
                                           WORLD, f"({layout}, {schedule}, {name})")


@pytest.mark.multirank
@pytest.mark.parametrize("key", list(cases.EXTRAS))
def test_composability(results, key):
    """BigMac and the pairwise all-to-all over the EP&ESP block exactly; bf16 on the EP&ESP
    payloads with 2 chunks and OptSche to bf16 rounding."""
    schedule, name, _ = cases.EXTRAS[key]
    mp = parm_cases.LAYOUTS[cases.EXTRAS_LAYOUT][0]
    ref = cases.reference_parts(name, WORLD, mp, mp if schedule == "s1" else 1)
    for rank in range(WORLD):
        got = results[rank][("extra", key)]
        if not key.startswith("codec"):
            parm_cases.assert_rank_matches(got, ref, rank, WORLD, key)
            continue
        torch.testing.assert_close(got["y"], ref["y"][rank], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got["x_grad"], WORLD * ref["x_grad"][rank], rtol=2e-2,
                                   atol=2e-2)
        assert not torch.equal(got["y"], ref["y"][rank])        # the codec did round


def test_s1_reference_differs_from_the_whole_batch():
    """S1 gates each MP part alone, so its capacity (and drops) differ from the whole batch's
    (capacity 1.0: 6 tokens give C = 3, parts of 3 give C = 2): the S1 parity cases compare
    against a reference that gates the parts."""
    name = "expert_bias_capacity"
    a = cases.reference_s1(name, WORLD, 2, **parm_cases.CASES[name])
    b = parm_cases.reference(name, WORLD, 2)
    assert all(not torch.allclose(x, y) for x, y in zip(a["y"], b["y"]))


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [k for k, v in parm_cases.LAYOUTS.items() if v[0] > 1])
def test_saa_equals_aas(results, layout):
    for rank in range(WORLD):
        got = results[rank][(layout, "saa_vs_aas")]
        assert got["saa"][0].numel() > 0
        for i in range(2):
            torch.testing.assert_close(got["saa"][i], got["aas"][i], rtol=0, atol=0)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(parm_cases.LAYOUTS))
def test_auto_takes_algorithm1s_choice(results, layout):
    mp = parm_cases.LAYOUTS[layout][0]
    for want in ("s1", "s2"):
        ref = _reference(want, "capacity_k2", WORLD, mp)
        for rank in range(WORLD):
            chosen, y = results[rank][(layout, "auto")][want]
            assert chosen == want
            torch.testing.assert_close(y, ref["y"][rank], rtol=1e-9, atol=1e-12)


@pytest.mark.multirank
def test_refusals(results):
    e = results[0]["errors"]
    assert "parm_saa=True" in e["saa_codec"] and "codec='int8'" in e["saa_codec"]
    assert "parm_saa=False" in e["saa_chunks"] and "pipeline_degree=2" in e["saa_chunks"]
    assert "gate_noise=0.1" in e["noise"] and "'s1'" in e["noise"]
    assert "a2a='hier1d'" in e["a2a"] and "direct" in e["a2a"]


@pytest.mark.multirank
def test_measured_fits(results):
    fits = ParmFits.from_json(results[0]["fits"])
    for ab in (fits.ag_mp, fits.a2a, fits.overlap):
        assert math.isfinite(ab.alpha) and ab.alpha >= 0 and ab.beta >= 0
    assert len(results[0]["fits"]["points"]["overlap"]) == 2
    assert results[1]["fits"] == results[0]["fits"]          # every rank gets the same


def test_schedules_are_accepted_and_unknown_refused():
    for s in ("baseline", "s1", "s2", "auto"):
        assert MoEConfig(d_model=8, d_expert=8, num_experts=4,
                         parallel_schedule=s).parallel_schedule == s
    with pytest.raises(ConfigError, match="parallel_schedule='gpipe'.*unknown"):
        MoEConfig(d_model=8, d_expert=8, num_experts=4, parallel_schedule="gpipe")
    with pytest.raises(ConfigError, match="parm_saa=1"):
        MoEConfig(d_model=8, d_expert=8, num_experts=4, parm_saa=1)


def _fits(a2a=(1e-4, 1e-9), ag=(1e-4, 1e-9), o=(1e-4, 1e-9)) -> ParmFits:
    return ParmFits(ag_mp=AlphaBeta(*ag), a2a=AlphaBeta(*a2a), overlap=AlphaBeta(*o))


def test_algorithm1_lines():
    """Lines 1-5 by hand: x = B L M, T = k f B L / E, y = E T M N_ESP."""
    f = _fits(a2a=(1.0, 2.0), ag=(3.0, 5.0), o=(7.0, 11.0))
    p = algorithm1(f, tokens=8, E=4, M=3, k=2, f=1.5, n_esp=2, n_mp=2)
    x, T = 8 * 3, 2 * 1.5 * 8 / 4
    y = 4 * T * 3 * 2
    assert p.t_d1 == pytest.approx(2 * (1 + 2 * y / 2) + 3 + 5 * x)
    assert p.t_d2 == pytest.approx(1 + 2 * y / 2 + 7 + 11 * y)
    assert p.schedule == ("s1" if p.t_d1 <= p.t_d2 else "s2")


def test_algorithm1_follows_the_paper_limits():
    """Section IV-B: with N_ESP = 1 and T -> 0, S2 wins (t_D1 -> AG_MP(BLM)); as T grows, S1
    wins when the overlapped term grows faster than the AllGather of the input."""
    f = _fits(a2a=(1e-4, 1e-9), ag=(1e-4, 2e-9), o=(1e-4, 2e-9))
    assert algorithm1(f, 4096, 64, 512, 1, 0.01, 1, 2).schedule == "s2"
    assert algorithm1(f, 4096, 8, 512, 8, 2.4, 4, 2).schedule == "s1"
    # a tie goes to S1 (line 6: t_D1 <= t_D2)
    tie = _fits(a2a=(0, 0), ag=(1.0, 0), o=(1.0, 0))
    assert algorithm1(tie, 10, 2, 2, 1, 1.0, 1, 2).schedule == "s1"


@pytest.mark.multirank
@pytest.mark.slow      # the default run checks every schedule on the 4-rank layouts
def test_eight_ranks_match_the_reference():
    """(N_MP, N_EP, N_ESP) = (2, 2, 2) on 8 ranks as 2 nodes x 4, ESP and EP in the node:
    baseline, S1, S2 (SAA) and S2 (AAS), capacity and dropless, against one process in float64
    (one spawn of 8 ranks); SAA == AAS with 4 phases, forward and backward, bit for bit."""
    cases.check_eight_ranks()


def test_fit_sizes_span_the_call():
    """elements_around covers x = B L M and z = k f B L M N_ESP / N_MP (Algorithm 1 lines 1-3)."""
    sizes = elements_around(2048, 256, 2, 1.2, 2, 1)
    x, z = 2048 * 256, 2 * 1.2 * 2048 * 256 * 2
    assert len(sizes) == 3 and sizes[0] == round(x / 4) and sizes[-1] == round(z)
    assert sizes[0] < sizes[1] < sizes[2]
    with pytest.raises(ValueError, match="points=1"):
        elements_around(8, 8, 1, 1.0, 1, 1, points=1)


def test_auto_measures_fits_around_its_first_call(monkeypatch):
    """Without given fits, auto measures them once per topology, at the first call's sizes."""
    import importlib

    from moeflow.topology import Topology
    a1 = importlib.import_module("moeflow.strategies.parm.algorithm1")  # the module, not the fn
    calls = []

    def fake(topo, elements, width, device):
        calls.append((elements, width, str(device)))
        return _fits(a2a=(0, 1e-9), ag=(0, 1e-9), o=(0, 1e-9))

    monkeypatch.setattr(a1, "measure_parm_fits", fake)
    topo = Topology(rank=0, world_size=1, local_size=1, ep_size=1)
    cfg = MoEConfig(d_model=16, d_expert=32, num_experts=4, parallel_schedule="auto")
    auto = a1.AutoSchedule(topo)
    try:
        auto.choose(cfg, 128, 2, 1.5)
        a1.AutoSchedule(topo).choose(cfg, 4096, 2, 1.5)      # the topology's fits are reused
    finally:
        a1._FITS.pop(id(topo), None)
    assert calls == [(elements_around(128, 16, 2, 1.5, 1, 1), 16, "cpu")]
    assert auto.last is not None and auto.fits is not None
