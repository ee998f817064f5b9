"""``counting``: the ``direct`` all-to-all that also counts the bytes handed to it.

Registered for benchmarks and tests that check the all-to-all volume of a structure against
its formula (BigMac Eq. 1: BigMac moves ``r`` times the bytes of the fine-grained MoE). Every
call to ``start`` adds the payload's bytes (tokens, forward and backward) to
``payload_bytes`` (and the part sent to other ranks to ``offrank_bytes``). The per-expert counts
that travel first are not an all-to-all (one all-gather per layer call,
:mod:`moeflow.comm.exchange`) and are not counted.
"""

from __future__ import annotations

import torch

from moeflow.comm.alltoall.base import ALLTOALLS, Pending
from moeflow.comm.alltoall.direct import DirectAllToAll


class CountingAllToAll(DirectAllToAll):
    def __init__(self, topo):
        super().__init__(topo)
        self.reset()

    def reset(self) -> None:
        self.payload_bytes = self.offrank_bytes = self.calls = 0

    def start(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              matrix: list[list[int]] | None = None) -> Pending:
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        total = sum(send_splits) * row
        self.payload_bytes += total
        self.offrank_bytes += total - send_splits[self.topo.ep_rank] * row
        self.calls += 1
        return super().start(x, send_splits, recv_splits, matrix)


if "counting" not in ALLTOALLS:
    ALLTOALLS.register("counting")(CountingAllToAll)
