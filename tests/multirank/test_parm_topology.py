"""Parm's MP+EP+ESP topology: DeviceMesh groups, both placements, errors for bad layouts."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moeflow.config import ConfigError
from moeflow.devices import group_backend
from moeflow.launch import launch_local
from moeflow.topology import Topology

WORLD = 4


def test_single_process_refuses_parm_sizes():
    with pytest.raises(ConfigError, match="esp_size=2.*init_process_group"):
        Topology.from_env(esp_size=2)


def _members(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _topology_worker():
    out = {}
    for in_node in (True, False):
        topo = Topology.from_env(ep_size=2, local_size=2, esp_size=2, esp_in_node=in_node)
        assert Topology.from_env(ep_size=2, local_size=2, esp_size=2,
                                 esp_in_node=in_node) is topo            # created once
        out[in_node] = {
            "coords": (topo.ep_rank, topo.esp_rank, topo.expert_slot, topo.expert_dp_size),
            "ep": _members(topo.ep_group), "esp": _members(topo.esp_group),
            "union": _members(topo.ep_esp_group), "edp": _members(topo.expert_dp_group),
            "backends": {dist.get_backend_config(g) for g in
                         (topo.ep_group, topo.esp_group, topo.ep_esp_group, topo.mp_group,
                          topo.dp_group, topo.expert_dp_group)} == {group_backend()},
            "mesh": topo.mesh.mesh_dim_names}
    mp = Topology.from_env(ep_size=2, local_size=2, mp_size=2)
    out["mp"] = (mp.mp_rank, mp.dp_size, _members(mp.mp_group), _members(mp.dp_group),
                 _members(mp.ep_group), mp.expert_dp_size)
    errors = {}
    bad = {"esp3": dict(esp_size=3, local_size=2),
           "blocks": dict(ep_size=4, esp_size=2, local_size=2),
           "esp_not_in_node": dict(ep_size=1, esp_size=4, local_size=2),
           "ep_not_in_node": dict(ep_size=2, esp_size=2, local_size=1, esp_in_node=False)}
    for key, kw in bad.items():
        try:
            Topology.from_env(**kw)
        except ConfigError as e:
            errors[key] = str(e)
    out["errors"] = errors
    return out


@pytest.mark.multirank
@pytest.mark.slow   # the Parm parity tests of the default run build these groups (test_parm_schedules.py, test_parm_ted.py)
def test_groups_and_placements():
    out = launch_local(_topology_worker, WORLD)
    for r in range(WORLD):
        case2, case3 = out[r][True], out[r][False]
        # ESP in node (case 2): ESP groups {0,1},{2,3}; EP groups {0,2},{1,3}
        assert case2["coords"] == (r // 2, r % 2, r, 1)
        assert case2["esp"] == [2 * (r // 2), 2 * (r // 2) + 1]
        assert case2["ep"] == [r % 2, r % 2 + 2]
        # EP in node (case 3): the other way round
        assert case3["coords"] == (r % 2, r // 2, r, 1)
        assert case3["ep"] == case2["esp"] and case3["esp"] == case2["ep"]
        for c in (case2, case3):
            assert c["union"] == [0, 1, 2, 3] and c["edp"] == [r] and c["backends"]
        assert case2["mesh"] == ("edp", "ep", "esp") and case3["mesh"] == ("edp", "esp", "ep")
        node = [2 * (r // 2), 2 * (r // 2) + 1]
        assert out[r]["mp"] == (r % 2, 2, node, [r % 2, r % 2 + 2], node, 2)
    errors = out[0]["errors"]
    assert set(errors) == {"esp3", "blocks", "esp_not_in_node", "ep_not_in_node"}
    assert "esp_size=3" in errors["esp3"] and "world size 4" in errors["esp3"]
    assert "ep_size=4 x esp_size=2" in errors["blocks"] and "world size 4" in errors["blocks"]
    assert ("esp_size=4 cannot be placed" in errors["esp_not_in_node"]
            and "esp_in_node=False" in errors["esp_not_in_node"])
    assert ("ep_size=2 cannot be placed" in errors["ep_not_in_node"]
            and "4 nodes x 1 ranks" in errors["ep_not_in_node"])
