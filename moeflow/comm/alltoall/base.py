"""The all-to-all interface and its registry (ScheMoE section 3.1, Listing 2).

An algorithm is built for a :class:`~moeflow.topology.Topology` and exchanges a tensor over the
topology's expert-parallel group: rank ``i`` sends rows ``[sum(send[:j]), sum(send[:j+1]))`` to
rank ``j`` and receives ``recv[j]`` rows from rank ``j``, stacked in source-rank order. ``start``
returns a :class:`Pending` handle so that a scheduler can overlap the exchange with compute.

``matrix`` is the whole split matrix ``S[src][dst]`` of the exchange when the caller knows it
(the MoE layer learns every rank's counts once per call): multi-step algorithms derive their
intermediate layouts from it instead of all-gathering the splits again. Without it they gather
it themselves (one small collective and a host copy).

On CUDA the MoE layer calls ``start(...).wait()`` on its communication lane with the lane's
stream current: collectives are issued ``async_op`` and a ``wait()`` is a stream dependency, so
an algorithm's layout copies between its steps run on that stream and the host never blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from moeflow.comm import wait_watch
from moeflow.registry import Registry
from moeflow.topology import Topology


class Pending:
    """An exchange in flight; ``wait()`` returns the received tensor. ``work``: the
    collective's work handle, reported to the process's
    :mod:`~moeflow.comm.wait_watch` watcher if one is installed (which then runs the wait)."""

    def __init__(self, wait: Callable[[], torch.Tensor], work=None):
        self._wait = wait
        self._result: torch.Tensor | None = None
        self._watcher = wait_watch.current() if work is not None else None
        self._token = self._watcher.issued(work) if self._watcher is not None else None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = (self._wait() if self._watcher is None
                            else self._watcher.wait(self._token, self._wait))
        return self._result


class AllToAll(ABC):
    name: str = "?"

    def __init__(self, topo: Topology):
        self.check_topology(topo)
        self.topo = topo

    @classmethod
    def check_topology(cls, topo: Topology) -> None:
        """Raise ConfigError if this algorithm cannot run on ``topo`` (e.g. needs several nodes)."""

    @abstractmethod
    def start(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              matrix: list[list[int]] | None = None) -> Pending:
        """Begin the exchange of ``x`` (rows split by ``send_splits``)."""

    def start_combine(self, x: torch.Tensor, send_splits: list[int],
                      recv_splits: list[int], matrix: list[list[int]] | None = None
                      ) -> Pending:
        """The exchange from the experts back to the tokens' ranks (and, in backward, the
        gradient of the dispatch). Same contract as ``start``; an algorithm whose stages have a
        direction (SMILE's bi-level: inter then intra to dispatch, intra then inter back)
        overrides it. By default it is ``start``."""
        return self.start(x, send_splits, recv_splits, matrix)

    def inter_node_rows(self, send_splits: list[int], matrix: list[list[int]] | None,
                        combine: bool = False) -> int:
        """Rows this rank puts on inter-node links in one exchange (``combine``: the way
        back), from the split sizes alone (no communication). The default is a one-hop
        algorithm: every block bound for a rank of another node crosses once. Multi-step
        algorithms count their inter-node stage."""
        topo = self.topo
        if topo.ep_size == 1 or topo.num_nodes == 1:
            return 0
        me = topo.node_rank
        return sum(rows for j, rows in enumerate(send_splits)
                   if rows and ep_global_rank(topo, j) // topo.local_size != me)

    def exchange(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                 combine: bool = False, matrix: list[list[int]] | None = None) -> torch.Tensor:
        start = self.start_combine if combine else self.start
        return start(x, send_splits, recv_splits, matrix).wait()


def ep_global_rank(topo: Topology, j: int) -> int:
    """The world rank of expert-parallel rank ``j`` of this rank's EP group."""
    if topo.ep_size == topo.world_size:
        return j
    import torch.distributed as dist
    return dist.get_global_rank(topo.ep_group, j)


ALLTOALLS = Registry("alltoall", AllToAll)
register_alltoall = ALLTOALLS.register
