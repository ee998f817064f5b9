"""Parm's schedules sending only the kept rows (``capacity_padding="trim"``; beyond the Parm
paper, ``moeflow/strategies/parm/padding.py``): float64, trimmed equals padded (outputs, aux
loss, input and parameter gradients) for ted, the pipelined ted, S1 and the MP-drop baseline
on the 4-rank layouts, with drops and with experts that get no row; the ted's bytes to other
nodes are the kept rows'; S2 and the baseline with ESP shards pad; Algorithm 1's kept-rows
terms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow.launch import launch_local
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.strategies.parm.algorithm1 import AutoSchedule, algorithm1, ted_time
from moeflow.strategies.parm.fits import ParmFits
from moeflow.strategies.parm.padding import schedule_trims
from moeflow.topology import Topology
from tests.helpers import parm_cases, parm_trim_cases as cases
from tests.helpers.parity import D_MODEL

WORLD = 4


@pytest.fixture(scope="module")
def results():
    return launch_local(cases.rank_worker, WORLD, timeout_s=300)


def _runs(results):
    """(layout, variant, case) of every pad / trim pair the ranks ran."""
    return sorted({key[:3] for key in results[0] if key[3] == "pad"})


@pytest.mark.multirank
def test_trimmed_equals_padded(results):
    for layout, variant, name in _runs(results):
        for rank in range(WORLD):
            pad = results[rank][(layout, variant, name, "pad")]
            trim = results[rank][(layout, variant, name, "trim")]
            label = f"({layout}, {variant}, {name}, rank {rank})"
            assert pad["stats"]["parm_trimmed"] == 0.0 and pad["kept"] is None, label
            assert trim["stats"]["parm_trimmed"] == 1.0, label
            for key in ("y", "x_grad", "aux"):
                torch.testing.assert_close(trim[key], pad[key], msg=f"{key} {label}")
            assert trim["grads"].keys() == pad["grads"].keys()
            for n, g in pad["grads"].items():
                torch.testing.assert_close(trim["grads"][n], g, msg=f"grad {n} {label}")
            for key in ("balance_loss", "dropped_fraction"):
                assert trim["stats"][key] == pytest.approx(pad["stats"][key]), label


@pytest.mark.multirank
def test_the_cases_have_drops_and_experts_without_rows(results):
    """The comparison is not vacuous: ranks drop choices, and some expert keeps no row."""
    kept = [results[r][(layout, "ted", name, "trim")]
            for layout in parm_cases.LAYOUTS for name in cases.CASES for r in range(WORLD)]
    assert any(k["kept"].sum() < k["tokens"] * k["top_k"] for k in kept)
    assert any((k["kept"] == 0).any() for k in kept)


@pytest.mark.multirank
def test_trimmed_ted_sends_only_the_kept_rows_to_the_other_node(results):
    """(1,2,2), ESP in the node: only the EP-AlltoAll crosses, each row once. Rank r (EP rank
    r // 2) sends its kept rows for the other node's experts and gets back the kept rows the
    rank of the other node with its ESP index (r ^ 2) sent to its experts, float64: 8 bytes
    an element, ``M`` elements a row; fewer than the padded buffer's."""
    layout = "ep2_esp2_esp_in_node"
    for name in cases.CASES:
        for rank in range(WORLD):
            trim = results[rank][(layout, "ted", name, "trim")]
            peer = results[rank ^ 2][(layout, "ted", name, "trim")]["kept"]
            el = trim["kept"].size // 2
            mine = np.zeros(trim["kept"].size, dtype=bool)
            mine[(rank // 2) * el:(rank // 2 + 1) * el] = True
            rows = int(trim["kept"][~mine].sum() + peer[mine].sum())
            got = trim["stats"]["parm_inter_node_bytes"]
            assert got == rows * D_MODEL * 8, (name, rank)
            padded = results[rank][(layout, "ted", name, "pad")]["stats"]
            assert got < padded["parm_inter_node_bytes"], (name, rank)
            piped = results[rank][(layout, "ted_r2", name, "trim")]["stats"]
            assert piped["parm_inter_node_bytes"] == got, (name, rank)


@pytest.mark.multirank
def test_s2_and_the_baseline_with_esp_shards_pad(results):
    for variant in ("s2", "baseline"):
        for rank in range(WORLD):
            got = results[rank][("mp2_esp2_esp_in_node", variant, "capacity_k1_tight", "trim")]
            assert got["stats"]["parm_trimmed"] == 0.0 and got["kept"] is None, (variant, rank)


def test_which_schedules_trim():
    """Whole-expert baseline, ted (and its pipelined names) and S1 trim; S2 and the baseline
    with ESP shards pad."""
    esp = Topology(rank=0, world_size=4, local_size=2, ep_size=2, esp_size=2)
    whole = Topology(rank=0, world_size=4, local_size=2, ep_size=2, mp_size=2)
    assert schedule_trims(None, whole) and not schedule_trims(None, esp)
    for topo in (esp, whole):
        assert all(schedule_trims(s, topo) for s in ("ted", "ted-r2", "ted-r4", "s1"))
        assert not schedule_trims("s2", topo)


def _ab(alpha, beta):
    return AlphaBeta(alpha, beta)


def test_algorithm1_takes_the_kept_rows_for_the_candidates_that_trim():
    """A trimming candidate's byte terms use ``f'`` (kept rows / k B L) for f; S2 pads and
    keeps f; without ``f_kept`` nothing changes."""
    fits = ParmFits(_ab(1e-3, 1e-9), _ab(2e-3, 2e-9), _ab(3e-3, 3e-9), a2a_ep=_ab(2e-3, 2e-9),
                    ag_esp=_ab(3e-3, 3e-9), rs_esp=_ab(4e-3, 4e-9))
    args = (fits, 512, 8, 64, 2, 2.5, 2, 2, 4, (2,))
    padded = algorithm1(*args)
    trimmed = algorithm1(*args, frozenset({"ted", "s1"}), 0.8)
    assert trimmed.t_ted == pytest.approx(ted_time(fits, 512, 64, 2, 0.8, 2, 2, 4))
    assert trimmed.t_ted < padded.t_ted
    assert dict(trimmed.t_ted_pipelined)[2] < dict(padded.t_ted_pipelined)[2]
    y1 = 8 * (2 * 0.8 * 512 / 8) * 64 * 2                     # lines 2-3 with f' = 0.8
    assert trimmed.t_d1 == pytest.approx(2 * (2e-3 + 2e-9 * y1 / 2) + 1e-3 + 1e-9 * 512 * 64)
    assert trimmed.t_d2 == padded.t_d2                        # S2 pads: f
    assert algorithm1(*args, frozenset({"ted"}), 0.8).t_d1 == padded.t_d1
    assert algorithm1(*args, frozenset({"ted", "s1"}), None) == padded


def test_algorithm1_may_choose_otherwise_when_padding_is_not_sent():
    """Fits where S2 (1.78 ms) beats the padded ted (2.67 ms) at f = 2.5; with 0.8 of the
    choices kept the trimmed ted (0.89 ms) wins."""
    ted = _ab(1e-5, 5e-9)
    fits = ParmFits(ag_mp=_ab(1e-5, 1e-9), a2a=_ab(1e-4, 1e-8), overlap=_ab(1e-5, 1e-10),
                    a2a_ep=ted, ag_esp=ted, rs_esp=ted)
    args = (fits, 512, 8, 64, 2, 2.5, 2, 2, 4)
    assert algorithm1(*args).schedule == "s2"
    assert algorithm1(*args, (), frozenset({"ted"}), 0.8).schedule == "ted"


def test_auto_weighs_balanced_kept_rows_then_the_last_calls():
    """Before a trimmed call ``f' = min(f, 1)``; after one, its kept rows over its choices."""
    auto = AutoSchedule(Topology(rank=0, world_size=4, local_size=2, ep_size=2, esp_size=2))
    auto.fits = ParmFits(_ab(1e-3, 1e-9), _ab(2e-3, 2e-9), _ab(3e-3, 3e-9))

    class Cfg:
        num_experts, equal_rank_tokens, codec, pipeline_degree = 8, False, "none", 1

    auto._trimmed = frozenset({"s1"})
    first = auto._predict(Cfg, 512, 2, 2.5, 64)
    assert first.t_d1 == algorithm1(auto.fits, 512, 8, 64, 2, 1.0, 2, 1).t_d1
    auto.note_kept(300, 1024)
    after = auto._predict(Cfg, 512, 2, 2.5, 64)
    assert after.t_d1 == pytest.approx(algorithm1(auto.fits, 512, 8, 64, 2, 300 / 1024, 2,
                                                  1).t_d1)
    assert after.t_d2 == first.t_d2 == algorithm1(auto.fits, 512, 8, 64, 2, 2.5, 2, 1).t_d2
