"""The ``ted`` schedule (DeepSpeed-TED's order, node-once EP&ESP exchange; beyond the Parm
paper, ``moeflow/strategies/parm/ted.py``) and its pipelined chunks (ScheMoE's pipelining on
its order, ``ted_pipelined.py``): float64 parity with the single-process reference on the five
4-rank layouts, every case, its collectives' sizes and order, and Algorithm 1's choice."""

from __future__ import annotations

import pytest
import torch

from moeflow.launch import launch_local
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.strategies.parm.algorithm1 import (_from_terms, _terms, algorithm1,
                                                ted_pipelined_time, ted_time)
from moeflow.strategies.parm.fits import ParmFits
from tests.helpers import parm_cases, parm_ted_cases as cases

WORLD = 4
ECM = 4 * 16 * 8             # the trace's E C M per rank (f = 2, top-2: C = 16)


@pytest.fixture(scope="module")
def results():
    return launch_local(cases.rank_worker, WORLD, timeout_s=240)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(parm_cases.LAYOUTS))
def test_ted_parity(results, layout):
    """Outputs, aux loss, input and parameter gradients, clipped norm and parameters after an
    SGD step equal the reference's (TED gates the whole batch, as the baseline)."""
    mp = parm_cases.LAYOUTS[layout][0]
    for name in cases.TED_CASES:
        ref = parm_cases.reference(name, WORLD, mp)
        for rank in range(WORLD):
            parm_cases.assert_rank_matches(results[rank][(layout, name)], ref, rank, WORLD,
                                           f"({layout}, ted, {name})")


def _kinds(log):
    return [(c["phase"], c["op"].split("_single")[0].replace("_into_tensor", ""),
             len(c["group"]), c["elements"]) for c in log if len(c["group"]) > 1]


@pytest.mark.multirank
def test_each_row_crosses_once_and_fans_out_in_the_esp_group(results):
    """(1,2,2), ESP in the node: the EP-AlltoAll sends each row once (E C M, not the EP&ESP
    exchange's N_ESP E C M), the ESP-AllGather and ReduceScatter move N_ESP times that inside
    the ESP group; (2,2,1): 0.8.1's drop and gather (E C M / N_MP, then the MP-AllGather)."""
    got = _kinds(results[0][("ep2_esp2_esp_in_node", "trace")][0])
    one = [("all_to_all", 2, ECM), ("all_gather", 2, ECM), ("reduce_scatter", 2, 2 * ECM),
           ("all_to_all", 2, ECM)]
    assert got == [("forward",) + c for c in one] + [
        ("backward", "all_to_all", 2, ECM), ("backward", "all_gather", 2, ECM),
        ("backward", "reduce_scatter", 2, 2 * ECM), ("backward", "all_to_all", 2, ECM)]
    got = _kinds(results[0][("mp2_ep2", "trace")][0])
    part = ECM // 2
    assert got == [("forward", "all_to_all", 2, part), ("forward", "all_to_all", 2, part),
                   ("forward", "all_gather", 2, part), ("backward", "all_to_all", 2, part),
                   ("backward", "all_to_all", 2, part), ("backward", "all_gather", 2, part)]


@pytest.mark.multirank
def test_stats_count_the_bytes_sent_to_other_nodes(results):
    """2 nodes x 2 ranks, float32 (4 bytes), E C M = 512 elements per rank. (1,2,2) with ESP
    in the node: only the EP-AlltoAll crosses, each row once: out, the half of the buffer for
    the other node's experts (256 elements), and back the rows received from there (256):
    4 x 512 bytes. (1,2,2) with EP in the node: the EP-AlltoAll stays in the node; the
    ESP-AllGather sends the rows this rank received (its 2 experts' rows from both EP ranks,
    512 elements) to the remote ESP peer and the ReduceScatter hands it its block (512):
    8 x 512 bytes. (2,2,1): MP, EP and the block in one node: nothing."""
    for rank in range(WORLD):
        assert results[rank][("ep2_esp2_esp_in_node", "trace")][1] == 4 * ECM, rank
        assert results[rank][("ep2_esp2_ep_in_node", "trace")][1] == 4 * 2 * ECM, rank
        assert results[rank][("mp2_ep2", "trace")][1] == 0.0, rank


@pytest.mark.multirank
def test_codecs_are_refused_with_the_fix(results):
    assert "parallel_schedule='ted' is not supported with codec='bf16'" in results[0]["refusal"]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(parm_cases.LAYOUTS))
def test_auto_takes_ted_where_its_fits_are_cheapest(results, layout):
    for rank in range(WORLD):
        schedule, y = results[rank][(layout, "auto")]
        assert schedule == "ted"
        torch.testing.assert_close(y, results[rank][(layout, "capacity_k2")]["y"])


def _ab(alpha, beta):
    return AlphaBeta(alpha, beta)


def test_ted_time_is_the_sum_of_its_terms():
    """t_TED = 2 (a_ep + b_ep z) + a_ag_esp + b_ag_esp N_ESP z + a_rs_esp + b_rs_esp N_ESP z
    + a_ag + b_ag N_MP z, z = k f B L M / N_MP; groups of one rank cost nothing."""
    fits = ParmFits(_ab(1e-3, 1e-9), _ab(0, 0), _ab(0, 0), a2a_ep=_ab(2e-3, 2e-9),
                    ag_esp=_ab(3e-3, 3e-9), rs_esp=_ab(4e-3, 4e-9))
    z = 2 * 1.5 * 512 * 64 / 2
    want = (2 * (2e-3 + 2e-9 * z) + 3e-3 + 3e-9 * 2 * z + 4e-3 + 4e-9 * 2 * z
            + 1e-3 + 1e-9 * 2 * z)
    assert ted_time(fits, 512, 64, 2, 1.5, 2, 2, 4) == pytest.approx(want)
    no_esp = 2 * (2e-3 + 2e-9 * z) + 1e-3 + 1e-9 * 2 * z
    assert ted_time(fits, 512, 64, 2, 1.5, 1, 2, 4) == pytest.approx(no_esp)


def test_ted_is_weighed_only_with_its_fits_and_the_ep_size():
    cheap, dear = _ab(1e-6, 1e-12), _ab(1e-3, 1e-6)
    paper = ParmFits(cheap, cheap, dear)                        # the paper's three fits only
    p = algorithm1(paper, 512, 8, 64, 2, 1.2, 2, 2, n_ep=4)
    assert p.t_ted is None and p.schedule == "s1"
    full = ParmFits(dear, dear, dear, a2a_ep=cheap, ag_esp=cheap, rs_esp=cheap)
    assert algorithm1(full, 512, 8, 64, 2, 1.2, 2, 2, n_ep=4).schedule == "ted"
    assert algorithm1(full, 512, 8, 64, 2, 1.2, 2, 2).t_ted is None     # no n_ep: lines 1-9
    costly = ParmFits(cheap, cheap, cheap, a2a_ep=dear, ag_esp=dear, rs_esp=dear)
    p = algorithm1(costly, 512, 8, 64, 2, 1.2, 2, 2, n_ep=4)
    assert p.schedule in ("s1", "s2") and p.t_ted > max(p.t_d1, p.t_d2)


def test_fits_round_trip_with_and_without_the_ted_terms():
    full = ParmFits(_ab(1, 2), _ab(3, 4), _ab(5, 6), a2a_ep=_ab(7, 8), ag_esp=_ab(9, 1),
                    rs_esp=_ab(2, 3))
    back = ParmFits.from_json(full.to_json())
    assert (back.a2a_ep.beta, back.ag_esp.alpha, back.rs_esp.beta) == (8, 9, 3)
    old = ParmFits(_ab(1, 2), _ab(3, 4), _ab(5, 6)).to_json()
    assert "a2a_ep" not in old and ParmFits.from_json(old).a2a_ep is None


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(parm_cases.LAYOUTS))
def test_pipelined_ted_parity(results, layout):
    """The ted schedule in 2 pipelined chunks (every case) and in 3 sequential ones: outputs,
    aux loss, input and parameter gradients, clipped norm and parameters after an SGD step
    equal the single-process reference's, as the unchunked ted's do."""
    mp = parm_cases.LAYOUTS[layout][0]
    for variant, names in cases.PIPELINED_CASES.items():
        for name in names:
            ref = parm_cases.reference(name, WORLD, mp)
            for rank in range(WORLD):
                parm_cases.assert_rank_matches(results[rank][(layout, variant, name)], ref,
                                               rank, WORLD, f"({layout}, {variant}, {name})")


@pytest.mark.multirank
def test_pipelined_ted_interleaves_the_ep_and_esp_collectives(results):
    """(1,2,2), ESP in the node, 2 chunks: chunk 1's EP-AlltoAll is issued before chunk 0's
    ESP-AllGather / ReduceScatter (it runs under them), chunk 0's EP-AlltoAll back after them;
    each chunk moves half of the unchunked sizes; the backward the same on the gradients."""
    half = ECM // 2
    got = _kinds(results[0][("ep2_esp2_esp_in_node", "trace_pipelined")][0])
    order = [("all_to_all", 2, half), ("all_to_all", 2, half), ("all_gather", 2, half),
             ("reduce_scatter", 2, ECM), ("all_to_all", 2, half), ("all_gather", 2, half),
             ("reduce_scatter", 2, ECM), ("all_to_all", 2, half)]
    assert got == [("forward",) + c for c in order] + [("backward",) + c for c in order]
    for rank in range(WORLD):      # the same bytes cross the nodes as without chunks
        assert results[rank][("ep2_esp2_esp_in_node", "trace_pipelined")][1] == 4 * ECM


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(parm_cases.LAYOUTS))
def test_auto_takes_the_pipelined_ted_where_it_wins(results, layout):
    """Bandwidth-bound EP and ESP fits: with both groups (1,2,2) the 4 pipelined chunks win;
    with one of them of one rank there is nothing to overlap and the chunks only add
    latencies, so the unchunked ted is taken. The output is the ted schedule's."""
    both = parm_cases.LAYOUTS[layout][1] > 1 and parm_cases.LAYOUTS[layout][2] > 1
    for rank in range(WORLD):
        schedule, y = results[rank][(layout, "auto_pipelined")]
        assert schedule == ("ted-r4" if both else "ted")
        torch.testing.assert_close(y, results[rank][(layout, "capacity_k2")]["y"])


@pytest.mark.multirank
def test_other_schedulers_are_refused_for_the_ted_chunks(results):
    msg = results[0]["refusal_optsche"]
    assert "MoEConfig.schedule='optsche' is not supported with parallel_schedule='ted'" in msg
    assert "sequential, pipelined" in msg


def test_pipelined_time_is_the_fill_plus_the_slower_group_per_chunk():
    """t = t_ep + t_esp + (r - 1) max(t_ep, t_esp) + t_ag_mp, per chunk of z / r rows; r = 1
    is t_TED; a group of one rank costs nothing."""
    fits = ParmFits(_ab(1e-3, 1e-9), _ab(0, 0), _ab(0, 0), a2a_ep=_ab(2e-3, 2e-9),
                    ag_esp=_ab(3e-3, 3e-9), rs_esp=_ab(4e-3, 4e-9))
    z = 2 * 1.5 * 512 * 64 / 2
    for r in (1, 2, 4):
        ep = 2 * (2e-3 + 2e-9 * z / r)
        esp = 3e-3 + 3e-9 * 2 * z / r + 4e-3 + 4e-9 * 2 * z / r
        want = ep + esp + (r - 1) * max(ep, esp) + 1e-3 + 1e-9 * 2 * z
        assert ted_pipelined_time(fits, 512, 64, 2, 1.5, 2, 2, 4, r) == pytest.approx(want)
    assert ted_pipelined_time(fits, 512, 64, 2, 1.5, 2, 2, 4, 1) == pytest.approx(
        ted_time(fits, 512, 64, 2, 1.5, 2, 2, 4))
    ep = 2 * (2e-3 + 2e-9 * z / 4)                                      # no ESP group
    assert ted_pipelined_time(fits, 512, 64, 2, 1.5, 1, 2, 4, 4) == pytest.approx(
        4 * ep + 1e-3 + 1e-9 * 2 * z)


def test_algorithm1_weighs_the_pipelined_ted_on_made_up_fits():
    """Bandwidth-bound EP and ESP of comparable times: 4 chunks beat 2, which beat none;
    latency-bound ones: the unchunked ted; S1 / S2 cheapest: they stay; no ted fits: no
    pipelined candidate either. The prediction survives the ranks' all-reduce encoding."""
    dear, cheap = _ab(1e-3, 1e-6), _ab(1e-6, 1e-12)
    bw = _ab(1e-9, 1e-8)
    fits = ParmFits(dear, dear, dear, a2a_ep=bw, ag_esp=bw, rs_esp=bw)
    p = algorithm1(fits, 512, 8, 64, 2, 1.2, 2, 1, n_ep=4, ted_chunks=(2, 4))
    times = dict(p.t_ted_pipelined)
    assert p.schedule == "ted-r4" and times[4] < times[2] < p.t_ted
    assert _from_terms(_terms(p)) == p
    lat = ParmFits(dear, dear, dear, a2a_ep=_ab(1e-2, 1e-12), ag_esp=cheap, rs_esp=cheap)
    assert algorithm1(lat, 512, 8, 64, 2, 1.2, 2, 1, n_ep=4, ted_chunks=(2, 4)).schedule == "ted"
    low = ParmFits(cheap, cheap, cheap, a2a_ep=dear, ag_esp=dear, rs_esp=dear)
    p = algorithm1(low, 512, 8, 64, 2, 1.2, 2, 1, n_ep=4, ted_chunks=(2, 4))
    assert p.schedule in ("s1", "s2")
    paper = ParmFits(dear, dear, dear)
    p = algorithm1(paper, 512, 8, 64, 2, 1.2, 2, 1, n_ep=4, ted_chunks=(2, 4))
    assert p.t_ted is None and p.t_ted_pipelined == () and _from_terms(_terms(p)) == p
