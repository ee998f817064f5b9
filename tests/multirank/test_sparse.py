"""spAG / spRS (HECATE Section 3.1) against dense references, their volumes vs Eq. 1-2, errors;
the grouped-broadcast transport against point-to-point."""

from __future__ import annotations

import pytest
import torch

from moeflow.comm.sparse import (SparseCollectiveError, allreduce_volume, spag_send_bytes,
                                 sparsity_bound, sprs_send_bytes)
from moeflow.launch import launch_local
from tests.helpers import sparse_worker as sw

CHUNK_BYTES = 3 * 5 * 8


@pytest.fixture(scope="module")
def results():
    return launch_local(sw.worker, sw.WORLD, timeout_s=60)


def test_cases_are_not_trivial():
    replicated = [sum(len(h) > 1 for h in p1) for p0, p1 in sw.CASES.values()]
    assert min(replicated) >= 1 and max(len(h) for _, p1 in sw.CASES.values() for h in p1) == 4
    assert any(not any(p0[c] == [r] for c in range(len(p0)))     # a rank owning nothing
               for p0, _ in sw.CASES.values() for r in range(sw.WORLD))


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(sw.CASES))
def test_spag_sprs_match_dense_reference(results, name):
    p0, p1 = sw.CASES[name]
    for rank in range(sw.WORLD):
        res = results[rank]["cases"][name]
        seed = res["seed"]
        # spAG: every P1 holder has the owner's chunk, bit for bit
        assert sorted(res["gathered"]) == [c for c in range(len(p1)) if rank in p1[c]]
        for c, t in res["gathered"].items():
            assert torch.equal(t, sw.value(seed, p0[c][0], c)), (name, rank, c)
        # spRS(P1 -> P0): the owner has the sum of the P1 holders' copies (ascending ranks)
        assert sorted(res["reduced"]) == [c for c in range(len(p0)) if p0[c] == [rank]]
        for c, t in res["reduced"].items():
            ref = sw.value(seed + 1, min(p1[c]), c).clone()
            for r in sorted(p1[c])[1:]:
                ref += sw.value(seed + 1, r, c)
            assert torch.equal(t, ref), (name, rank, c)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(sw.CASES))
def test_grouped_broadcast_transport_matches_point_to_point(results, name):
    """transport="broadcast" (one broadcast / reduce per chunk in its holder set's group):
    spAG bit for bit, spRS to float64 rounding (the backend's reduce order)."""
    for rank in range(sw.WORLD):
        p2p, bc = results[rank]["cases"][name], results[rank]["broadcast"][name]
        assert sorted(bc["gathered"]) == sorted(p2p["gathered"])
        for c, t in bc["gathered"].items():
            assert torch.equal(t, p2p["gathered"][c]), (name, rank, c)
        assert sorted(bc["reduced"]) == sorted(p2p["reduced"])
        for c, t in bc["reduced"].items():
            torch.testing.assert_close(t, p2p["reduced"][c], rtol=1e-13, atol=1e-15)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(sw.CASES))
def test_volumes_vs_eq1_eq2(results, name):
    p0, p1 = sw.CASES[name]
    ag = [results[r]["cases"][name]["ag_bytes"] for r in range(sw.WORLD)]
    rs = [results[r]["cases"][name]["rs_bytes"] for r in range(sw.WORLD)]
    # measured = predicted, per rank
    assert [s for s, _ in ag] == spag_send_bytes(p0, p1, CHUNK_BYTES, sw.WORLD)
    assert [s for s, _ in rs] == sprs_send_bytes(p1, p0, CHUNK_BYTES, sw.WORLD)
    assert sum(s for s, _ in ag) == sum(r for _, r in ag)
    assert sum(s for s, _ in rs) == sum(r for _, r in rs)
    # Eq. 1: each rank receives at most lambda*S in spAG and sends at most lambda*S in spRS
    bound = sparsity_bound(p1, CHUNK_BYTES)
    assert max(r for _, r in ag) <= bound and max(s for s, _ in rs) <= bound
    # Eq. 2: spAG + spRS move what the ring all-reduces of every replicated chunk move in
    # total (each Eq. 2 term is one group member's share: times |D_i| for the group)
    total = sum(s for s, _ in ag) + sum(s for s, _ in rs)
    per_group = [allreduce_volume([h], CHUNK_BYTES) * len(h) for h in p1]
    assert total == pytest.approx(sum(per_group))
    assert total == sum(2 * (len(h) - 1) * CHUNK_BYTES for h in p1)


@pytest.mark.multirank
def test_eq1_worst_case_is_reached(results):
    """Rank 3 receives every replicated chunk: its spAG volume is exactly lambda*S."""
    p0, p1 = sw.WORST
    assert results[3]["cases"]["worst"]["ag_bytes"][1] == sparsity_bound(p1, CHUNK_BYTES) \
        == 3 * CHUNK_BYTES
    assert allreduce_volume(p1, CHUNK_BYTES) == 3 * CHUNK_BYTES    # 3 pairs: 2*(1/2) each


@pytest.mark.multirank
def test_subgroup_uses_group_ranks(results):
    assert results[0]["subgroup"] is None and results[2]["subgroup"] is None
    assert results[1]["subgroup"] == ({0: 1.0, 2: 23.0}, {0: 2.0})
    assert results[3]["subgroup"] == ({0: 1.0, 1: 13.0, 2: 23.0}, {1: 13.0, 2: 46.0})


@pytest.mark.multirank
def test_precondition_errors_raise_on_every_rank(results):
    err = [results[r]["errors"] for r in range(sw.WORLD)]
    assert "rank 2 passed chunks [0, 2] but P0 places [2] on it" in err[2]["wrong_chunks"]
    assert all("failed on ranks [2]" in err[r]["wrong_chunks"] for r in (0, 1, 3))
    assert "rank 1 chunk 1 is (3, 5) torch.float32" in err[1]["wrong_dtype"]
    assert all("failed on ranks [1]" in err[r]["wrong_dtype"] for r in (0, 2, 3))
    assert all("ranks [3] called it with other placements" in err[r]["disagree"]
               for r in (0, 1, 2))
    assert "ranks [0, 1, 2] called it with other placements" in err[3]["disagree"]
    assert all("requires P0 ⊆ P1" in e["not_superset"] for e in err)
    assert all("P1 must place every chunk on exactly one rank" in e["rs_two_owners"]
               for e in err)
    assert [e["after"] for e in err] == [[0, 2], [0, 1], [2], [3]]


@pytest.mark.multirank
def test_waits_are_bounded_by_the_group_timeout(results):
    msg, seconds = results[0]["errors"]["timeout"]
    assert "Timed out" in msg and 1.5 < seconds < 20


@pytest.mark.parametrize("fn,p0,p1,match", [
    (spag_send_bytes, [[0, 1]], [[0, 1]], r"P0\[0\]=\[0, 1\]: P0 must place every chunk"),
    (spag_send_bytes, [[]], [[0]], r"P0\[0\]=\[\]"),
    (spag_send_bytes, [[0]], [[1]], r"P0 ⊆ P1"),
    (spag_send_bytes, [[0]], [[0], [1]], "P0 has 1 chunks and P1 2"),
    (spag_send_bytes, [[0]], [[0, 4]], r"P1\[0\] names ranks \['4'\] outside the group of 4"),
    (sprs_send_bytes, [[0]], [[0, 1]], r"P1\[0\]=\[0, 1\]: P1 must place"),
    (sprs_send_bytes, [[0]], [[1]], r"P1 ⊆ P0"),
])
def test_placement_preconditions(fn, p0, p1, match):
    with pytest.raises(SparseCollectiveError, match=match):
        fn(p0, p1, 8, 4)
