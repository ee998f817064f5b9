"""Rank side of tests/multirank/test_sparse.py: spAG / spRS on random chunk placements (both
transports), and their errors."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from moeflow.comm.sparse import SparseAllGather, SparseCollectiveError, SparseReduceScatter

SHAPE = (3, 5)
WORLD = 4


def value(seed: int, rank: int, chunk: int) -> torch.Tensor:
    """The tensor rank ``rank`` contributes for ``chunk`` in case ``seed`` (float64)."""
    g = torch.Generator().manual_seed(1000 * seed + 10 * chunk + rank)
    return torch.randn(SHAPE, generator=g, dtype=torch.float64)


def random_case(seed: int):
    """Owners (some rank may own nothing) and a random superset placement."""
    g = torch.Generator().manual_seed(seed)
    chunks = 3 + seed % 6
    owners = torch.randint(0, WORLD, (chunks,), generator=g).tolist()
    holders = []
    for c, o in enumerate(owners):
        extra = (torch.rand(WORLD, generator=g) < 0.4).nonzero().view(-1).tolist()
        holders.append(sorted({o, *extra}))
    return [[o] for o in owners], holders


# rank 3 receives every replicated chunk: the Eq. 1 worst case
WORST = ([[0], [1], [2], [0], [3]], [[0, 3], [1, 3], [2, 3], [0], [3]])
CASES = {**{f"random{s}": random_case(s) for s in range(8)}, "worst": WORST}


def run_cases(rank: int, transport: str = "p2p") -> dict:
    res = {}
    for name, (p0, p1) in CASES.items():
        seed = sum(map(ord, name))
        ag = SparseAllGather(p0, p1, SHAPE, torch.float64, transport=transport)
        mine = {c: value(seed, rank, c) for c in range(len(p0)) if rank in p0[c]}
        gathered = ag(mine)
        rs = SparseReduceScatter(p1, p0, SHAPE, torch.float64, transport=transport)
        grads = {c: value(seed + 1, rank, c) for c in range(len(p1)) if rank in p1[c]}
        reduced = rs(grads)
        res[name] = dict(seed=seed, gathered=gathered, reduced=reduced,
                         ag_bytes=(ag.send_bytes, ag.recv_bytes),
                         rs_bytes=(rs.send_bytes, rs.recv_bytes))
    return res


def run_subgroup(rank: int):
    """spAG / spRS on the group of ranks [1, 3] (group ranks 0, 1): peers are group ranks."""
    group = dist.new_group([1, 3])
    if rank not in (1, 3):
        return None
    g_rank = dist.get_rank(group)
    p0, p1 = [[0], [1], [1]], [[0, 1], [1], [0, 1]]
    mine = {c: torch.full(SHAPE, 10.0 * c + rank, dtype=torch.float64)
            for c in range(3) if g_rank in p0[c]}
    got = SparseAllGather(p0, p1, SHAPE, torch.float64, group=group)(mine)
    back = SparseReduceScatter(p1, p0, SHAPE, torch.float64, group=group)(got)
    return {c: t[0, 0].item() for c, t in got.items()}, {c: t[0, 0].item()
                                                        for c, t in back.items()}


def catch(fn) -> str:
    try:
        fn()
    except SparseCollectiveError as err:
        return str(err)
    return "no error"


def run_errors(rank: int) -> dict:
    out = {}
    p0, p1 = [[0], [1], [2], [3]], [[0, 1], [1], [2, 0], [3]]
    good = {c: value(0, rank, c) for c in range(4) if rank in p0[c]}
    # rank 2 passes a chunk it does not hold: every rank raises
    bad = dict(good)
    if rank == 2:
        bad[0] = value(0, rank, 0)
    out["wrong_chunks"] = catch(lambda: SparseAllGather(p0, p1, SHAPE, torch.float64)(bad))
    # rank 1's tensor has the wrong dtype
    bad = {c: (t.float() if rank == 1 else t) for c, t in good.items()}
    out["wrong_dtype"] = catch(lambda: SparseAllGather(p0, p1, SHAPE, torch.float64)(bad))
    # rank 3 believes in another P1
    other = [[0, 1], [1], [2], [3]] if rank == 3 else p1
    out["disagree"] = catch(lambda: SparseAllGather(p0, other, SHAPE, torch.float64)(good))
    # the constructor checks the placements on every rank
    out["not_superset"] = catch(lambda: SparseAllGather(p0, [[1], [1], [2], [3]], SHAPE,
                                                        torch.float64))
    out["rs_two_owners"] = catch(lambda: SparseReduceScatter(p1, p1, SHAPE, torch.float64))
    # the group still works after all these
    out["after"] = sorted(SparseAllGather(p0, p1, SHAPE, torch.float64)(good))
    # a peer that never joins: rank 0 waits for chunk 1 from rank 1 at most the group timeout
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        t0 = time.perf_counter()
        try:
            SparseAllGather([[0], [1]], [[0], [0, 1]], SHAPE, torch.float64, group=group,
                            verify=False)({0: value(0, 0, 0)})
            out["timeout"] = ("no error", 0.0)
        except RuntimeError as err:
            out["timeout"] = (f"{type(err).__name__}: {err}"[:300], time.perf_counter() - t0)
    dist.barrier()          # rank 1 stays alive while rank 0 times out
    return out


def worker() -> dict:
    rank = dist.get_rank()
    return {"cases": run_cases(rank), "broadcast": run_cases(rank, "broadcast"),
            "subgroup": run_subgroup(rank),
            "errors": run_errors(rank)}
