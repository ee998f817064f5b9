"""Every all-to-all algorithm moves exactly what ``direct`` moves, for any split sizes, in both
directions (dispatch ``start`` and ``start_combine``)."""

from __future__ import annotations

import pytest
import torch

from moeflow.comm.alltoall import ALLTOALLS
from moeflow.config import ConfigError
from moeflow.init import seeded_normal
from moeflow.launch import launch_local
from moeflow.topology import Topology

ALGOS = ["pairwise", "hier1d", "hier2d", "pipe", "bilevel"]


def _splits(world: int, trial: int) -> list[list[int]]:
    """A random split matrix with zeros (trial 0: all equal; trial 1: one rank sends nothing)."""
    gen = torch.Generator().manual_seed(100 + trial)
    S = torch.randint(0, 6, (world, world), generator=gen)
    if trial == 0:
        S[:] = 3
    if trial == 1:
        S[1] = 0
    return S.tolist()


def _worker(layouts: list[int]) -> dict:
    out = {}
    for local_size in layouts:
        topo = Topology.from_env(local_size=local_size)
        ref = ALLTOALLS["direct"](topo)
        for trial in range(4):
            S = _splits(topo.world_size, trial)
            send = S[topo.rank]
            recv = [S[s][topo.rank] for s in range(topo.world_size)]
            x = seeded_normal((sum(send), 3), 1.0, "a2a", trial, topo.rank, dtype=torch.float64)
            expect = ref.exchange(x, send, recv)
            for name in ALGOS:
                algo = ALLTOALLS[name](topo)
                out[(local_size, trial, name)] = all(
                    bool(torch.equal(algo.exchange(x, send, recv, combine), expect))
                    for combine in (False, True))
    return out


@pytest.fixture(scope="module")
def results():
    return {4: launch_local(_worker, 4, [2, 1], timeout_s=120),
            8: launch_local(_worker, 8, [2, 4], timeout_s=120)}


@pytest.mark.multirank
@pytest.mark.parametrize("name", ALGOS)
@pytest.mark.parametrize("world,local_size", [(4, 2), (4, 1), (8, 2), (8, 4)])
def test_algorithm_equals_direct(results, name, world, local_size):
    for rank, res in results[world].items():
        for trial in range(4):
            assert res[(local_size, trial, name)], (rank, trial)


@pytest.mark.parametrize("name", ["hier1d", "hier2d", "pipe", "bilevel"])
def test_hierarchical_algorithms_refuse_one_node(name):
    with pytest.raises(ConfigError, match="needs several nodes"):
        ALLTOALLS[name](Topology(rank=0, world_size=4, local_size=4, ep_size=4))
    with pytest.raises(ConfigError, match="ep_size=2"):
        ALLTOALLS[name](Topology(rank=0, world_size=4, local_size=2, ep_size=2))
