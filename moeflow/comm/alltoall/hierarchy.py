"""What the hierarchical all-to-all algorithms need from a topology.

They are defined on nodes x local ranks of the whole world, so the expert-parallel group must be
the world and there must be more than one node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.comm.alltoall.blocks import split_matrix
from moeflow.errors import ConfigError
from moeflow.topology import Topology


@dataclass
class Layout:
    """This rank's place in nodes x local ranks, and the whole split matrix ``S[src][dst]``."""

    N: int          # nodes
    L: int          # ranks per node
    n: int          # this rank's node
    l: int          # this rank's local rank
    S: list[list[int]]

    def g(self, node: int, local: int) -> int:
        """Global rank of (node, local)."""
        return node * self.L + local

    @classmethod
    def of(cls, topo: Topology, send_splits: list[int], device: torch.device,
           matrix: list[list[int]] | None = None) -> "Layout":
        """``matrix``: the split matrix when the caller knows it, else gathered here."""
        return cls(topo.num_nodes, topo.local_size, topo.node_rank, topo.local_rank,
                   matrix if matrix is not None
                   else split_matrix(send_splits, topo.world_group, device))


def require_nodes(name: str, topo: Topology) -> None:
    if topo.world_size > 1 and topo.ep_size != topo.world_size:
        raise ConfigError(
            f"MoEConfig.a2a={name!r} is invalid with ep_size={topo.ep_size} on a world of "
            f"{topo.world_size}: hierarchical all-to-alls run over the whole world; use "
            "ep_size=None (all ranks) or a2a='direct' / 'pairwise'")
    if topo.num_nodes < 2:
        raise ConfigError(
            f"MoEConfig.a2a={name!r} is invalid on {topo.num_nodes} node x {topo.local_size} "
            f"ranks: it needs several nodes; use a2a='direct' or 'pairwise', or run on several "
            "(emulated) nodes (torchrun's LOCAL_WORLD_SIZE, or Topology.from_env(local_size=...))")
