"""``moeflow bench parm --collectives``: the sizes of every schedule's forward collectives
(Eq. 1 / 11 / 14), and on 4 gloo ranks that each piece is timed alone with a positive time and
a prediction from the fits (``benchmarks.parm.parm_collectives``)."""

from __future__ import annotations

import pytest

from benchmarks.parm.parm_collectives import CHAINS, grid_elements, messages
from moeflow.dispatch.capacity import capacity
from moeflow.launch import launch_local
from moeflow.topology import Topology
from tests.helpers import parm_collectives_worker as worker


def _topo(rank, mp, ep, esp, world=4):
    return Topology(rank=rank, world_size=world, local_size=2, ep_size=ep, mp_size=mp,
                    esp_size=esp)


def test_message_sizes_follow_the_equations():
    n, M, E, k, f = 512, 8, 4, 2, 1.2
    cap = capacity(n, k, E, f)                         # 308: C = ceil(k f B L / E)
    # (1, 2, 2): baseline's ESP-AllGather gathers the peers' inputs (Eq. 1), EP-AlltoAll
    # sends the N_ESP send buffers rebuilt from them
    m = messages(_topo(0, 1, 2, 2), n, M, E, k, f)
    assert set(m["baseline"]) == {"ag_esp", "a2a_ep", "ar_esp", "a2a_ep_back"}
    assert m["baseline"]["ag_esp"].elements == 2 * n * M                   # B L M N_ESP
    assert m["baseline"]["ag_esp"].ag_rows == (n, n)
    assert m["baseline"]["a2a_ep"].send == (2 * 2 * cap,) * 2              # N_ESP e_local C
    assert m["baseline"]["ar_esp"].elements == 2 * E * cap * M
    # N_MP = 1: S1 and S2 exchange the same rows (Eq. 11 = Eq. 14 without MP)
    assert m["s1"]["a2a"].send == m["s2"]["a2a"].send == (2 * cap,) * 4
    assert "ag_mp" not in m["s1"] and "ag_mp" not in m["s2"]
    # (2, 2, 1): S1 gates B L / N_MP tokens; S2 splits the whole batch's capacity over MP
    m = messages(_topo(1, 2, 2, 1), n, M, E, k, f)
    c1 = capacity(n // 2, k, E, f)
    assert m["s1"]["a2a"].elements == E * c1 * M                         # E T M N_ESP / N_MP
    assert m["s1"]["ag_mp"].elements == n * M and m["s1"]["ag_mp"].ag_rows == (256, 256)
    share = [cap // 2, cap - cap // 2]
    assert m["s2"]["a2a"].send == (2 * share[1],) * 2                   # MP rank 1's share
    assert m["s2"]["a2a"].recv == (2 * share[0], 2 * share[1])          # slots 0, 1
    assert m["s2"]["saa"].send == m["s2"]["a2a"].recv                   # the rows go back
    assert m["s2"]["saa"].fit_x == 2 * m["s2"]["saa"].elements          # y = z N_MP (line 5)
    assert m["s2"]["ag_mp"].elements == E * cap * M                     # the partials, ETM
    assert "ag_esp" not in m["baseline"]                                # N_ESP = 1
    # the baseline drops the MP duplicates (0.8.1, whole experts): MP rank 1's share of
    # every expert's C rows out, the EP ranks' (slots 0, 1: MP ranks 0, 1) shares back, and
    # the MP-AllGather of the whole E C M
    assert m["baseline"]["a2a_ep"].send == (2 * share[1],) * 2
    assert m["baseline"]["a2a_ep"].recv == m["baseline"]["a2a_ep_back"].send == (
        2 * share[0], 2 * share[1])
    assert m["baseline"]["ag_mp"].elements == E * cap * M
    assert m["baseline"]["ag_mp"].ag_rows == (E * share[0], E * share[1])
    # (2, 1, 2): a block of one EP rank: S1 / S2 all-to-all over the 2 ESP shards; the
    # baseline's ESP group is the MP group: no gather, the all-reduce of one copy (0.8.1)
    m = messages(_topo(0, 2, 1, 2), n, M, E, k, f)
    assert "a2a_ep" not in m["baseline"] and m["s1"]["a2a"].group == "ep_esp"
    assert set(m["baseline"]) == {"ar_esp"} and m["baseline"]["ar_esp"].elements == E * cap * M
    # (2, 2, 2) on 8 ranks: ESP groups in the node are the MP groups (DeepSpeed's layout),
    # ESP groups across the node's MP groups gather the input
    inside = messages(Topology(rank=1, world_size=8, local_size=4, ep_size=2, mp_size=2,
                               esp_size=2), n, M, E, k, f)["baseline"]
    assert set(inside) == {"a2a_ep", "ar_esp", "a2a_ep_back"}
    assert inside["a2a_ep"].elements == inside["ar_esp"].elements == E * cap * M
    across = messages(Topology(rank=1, world_size=8, local_size=4, ep_size=2, mp_size=2,
                               esp_size=2, esp_in_node=False), n, M, E, k, f)["baseline"]
    assert across["ag_esp"].elements == 2 * n * M
    assert across["a2a_ep"].elements == across["ar_esp"].elements == 2 * E * cap * M


def test_grid_elements_span_the_messages():
    topo = _topo(0, 2, 2, 1)
    sizes = grid_elements(topo, [512, 2048], 8, 4, 2, [1.2])
    every = [p.elements for n in (512, 2048)
             for s in messages(topo, n, 8, 4, 2, 1.2).values() for p in s.values()]
    assert sizes[0] == min(every) and sizes[-1] == max(every) and len(sizes) == 4


def test_grid_elements_agree_over_the_ranks():
    """The fits are collective: every rank must measure at the same sizes, also where a rank's
    messages depend on its MP rank and slot (N_MP = 4, B L = 64: S2's capacity of 39 splits
    9 / 10 / 10 / 10 over the MP ranks). Ranks used to fit at their own messages' sizes, and
    the fits' all-to-all failed (gloo: size mismatch)."""
    grids = []
    for rank in range(8):
        topo = Topology(rank=rank, world_size=8, local_size=2, ep_size=2, mp_size=4, esp_size=1)
        grids.append(grid_elements(topo, [64], 256, 4, 2, [1.2]))
        own = [p.elements for s in messages(topo, 64, 256, 4, 2, 1.2).values()
               for p in s.values()]
        assert grids[-1][0] <= min(own) and max(own) <= grids[-1][-1]
    assert all(g == grids[0] for g in grids)
    per_rank = {min(p.elements for s in messages(
        Topology(rank=r, world_size=8, local_size=2, ep_size=2, mp_size=4, esp_size=1),
        64, 256, 4, 2, 1.2).values() for p in s.values()) for r in range(8)}
    assert len(per_rank) > 1          # the case the test is about: ranks' messages differ


@pytest.fixture(scope="module")
def results():
    return launch_local(worker.rank_worker, 4, timeout_s=240)


@pytest.mark.multirank
def test_every_piece_timed_with_a_prediction(results):
    got = {k: v for k, v in results[0].items() if k != "crossing"}
    for layout, table in got.items():
        assert set(table) == set(CHAINS), layout
        for sched, d in table.items():
            keys = [p["piece"] for p in d["pieces"]]
            assert keys == [k for k in CHAINS[sched] if k in keys], (layout, sched)
            for p in d["pieces"]:
                assert p["measured_ms"] > 0 and p["elements"] > 0
                assert p["predicted_ms"]["synthetic"] == pytest.approx(
                    1e3 * (1e-4 + 1e-9 * p["fit_x"]))
                assert p["predicted_ms"]["measured"] > 0
            assert d["chain_ms"] > 0 and d["equation_total_ms"]["synthetic"] > 0
            assert d["sum_of_pieces_ms"] == pytest.approx(
                sum(p["measured_ms"] for p in d["pieces"]))
    # the pieces each layout's schedules run (groups of one rank have none)
    assert [p["piece"] for p in got["1,2,2"]["baseline"]["pieces"]] == [
        k for k in CHAINS["baseline"] if k != "ag_mp"]
    assert [p["piece"] for p in got["2,2,1"]["s2"]["pieces"]] == ["a2a", "saa"]
    assert [p["piece"] for p in got["2,2,1"]["s1"]["pieces"]] == ["a2a", "a2a_back", "ag_mp"]
    assert [p["piece"] for p in got["2,2,1"]["baseline"]["pieces"]] == [   # 0.8.1's drop
        "a2a_ep", "a2a_ep_back", "ag_mp"]


@pytest.mark.multirank
def test_crossing_names_the_groups_that_span_nodes(results):
    """``bench parm`` marks per row which groups cross the nodes (2 nodes x 2 here)."""
    for rank, got in results.items():
        c = got["crossing"]
        # (1,2,2), ESP in the node: EP {r, r+2} and the block (all 4) cross, ESP does not
        assert c["1,2,2"] == {"mp": False, "ep": True, "esp": False, "ep_esp": True,
                              "baseline": True, "s1_s2": True}, rank
        # (2,2,1): MP, EP and the block are one node: nothing crosses
        assert not any(c["2,2,1"].values()), rank
        # (1,2,2), EP in the node: ESP {r, r+2} crosses, so the block does; EP does not
        assert c["1,2,2e"] == {"mp": False, "ep": False, "esp": True, "ep_esp": True,
                               "baseline": True, "s1_s2": True}, rank
