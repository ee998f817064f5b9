"""Topology coordinates and process groups on a 4-rank job seen as 2 nodes x 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeflow.config import ConfigError
from moeflow.launch import launch_local
from moeflow.topology import Topology


def _members(group) -> list[int]:
    """Ranks of ``group``, found by an all-gather of this rank's id over it."""
    n = dist.get_world_size(group)
    out = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t) for t in out]


def _groups_worker():
    topo = Topology.from_env(ep_size=2, local_size=2)
    assert Topology.from_env(ep_size=2, local_size=2) is topo       # created once, reused
    with pytest.raises(ConfigError, match="ep_size=3"):
        Topology.from_env(ep_size=3)
    return {"coords": (topo.num_nodes, topo.node_rank, topo.local_rank, topo.ep_rank,
                       topo.expert_dp_size),
            "ep": _members(topo.ep_group), "edp": _members(topo.expert_dp_group),
            "intra": _members(topo.intra_node_group), "inter": _members(topo.inter_node_group)}


@pytest.mark.multirank
def test_groups_of_two_nodes_by_two():
    out = launch_local(_groups_worker, 4)
    for r in range(4):
        node, local = divmod(r, 2)
        assert out[r]["coords"] == (2, node, local, r % 2, 2)
        assert out[r]["ep"] == out[r]["intra"] == [2 * node, 2 * node + 1]
        assert out[r]["edp"] == out[r]["inter"] == [local, local + 2]
