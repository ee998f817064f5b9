"""Importable by spawned ranks: an all-to-all algorithm that refuses every layout (to check that
``bench a2a`` skips it with its reason) and a worker that registers it before benchmarking."""

from __future__ import annotations

from moeflow.bench.a2a import a2a_worker
from moeflow.comm.alltoall import ALLTOALLS, AllToAll, register_alltoall
from moeflow.config import ConfigError


class NeedsManyNodes(AllToAll):
    @classmethod
    def check_topology(cls, topo):
        raise ConfigError(f"needs 64 nodes, this layout has {topo.num_nodes}")

    def start(self, x, send_splits, recv_splits, matrix=None):
        raise AssertionError("never built")


def a2a_with_refusing(sizes, warmup, reps):
    if "test-needs-many-nodes" not in ALLTOALLS:
        register_alltoall("test-needs-many-nodes")(NeedsManyNodes)
    return a2a_worker(None, sizes, warmup, reps)
