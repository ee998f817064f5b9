"""What the hierarchical all-to-all algorithms need from a topology.

They are defined on nodes x local ranks of the whole world, so the expert-parallel group must be
the world and there must be more than one node.
"""

from __future__ import annotations

from moeflow.config import ConfigError
from moeflow.topology import Topology


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
