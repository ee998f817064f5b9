"""Pieces of the emulated cluster that need no privileges: units, tc commands, names, torchrun
command line, output prefixes, capability parsing."""

from __future__ import annotations

import io
import threading

import pytest

from moeflow.cluster.launcher import ClusterSpec, _pump, torchrun_command
from moeflow.cluster.netns import ClusterError, EmulatedNetwork, Node, effective_caps, NAME_RE
from moeflow.cluster.shaping import LinkShape, format_rate, parse_latency, parse_rate
from moeflow.config import ConfigError


def test_units():
    assert parse_rate("1gbit") == 1e9 and parse_rate("100Mbit") == 1e8
    assert parse_rate("125mbps") == 1e9 and format_rate(2.5e8) == "250mbit"
    assert parse_latency("200us") == pytest.approx(2e-4) and parse_latency("1ms") == 1e-3
    with pytest.raises(ConfigError, match="--inter-bw='fast'.*1gbit"):
        parse_rate("fast", "--inter-bw")
    with pytest.raises(ConfigError, match="latency"):
        parse_latency("3 parsecs")


def test_tc_commands_rate_and_latency():
    shape = LinkShape(rate_bps=1e9, latency_s=2e-4)
    cmds = shape.tc_commands("ns0", "eth9", 1500)
    assert cmds[0][:8] == ["tc", "-n", "ns0", "qdisc", "add", "dev", "eth9", "root"]
    assert "netem" in cmds[0] and "200us" in cmds[0]
    assert cmds[1][7:10] == ["parent", "1:", "handle"] and "tbf" in cmds[1]
    assert cmds[1][cmds[1].index("rate") + 1] == "1000000000bit"
    assert int(cmds[1][cmds[1].index("burst") + 1]) >= 4 * 1500
    only_rate = LinkShape(rate_bps=1e8).tc_commands("n", "d", 1500)
    assert len(only_rate) == 1 and only_rate[0][7] == "root"
    assert LinkShape().tc_commands("n", "d", 1500) == [] and not LinkShape().limited


def test_names_fit_and_do_not_collide():
    a, b = EmulatedNetwork(12), EmulatedNetwork(12)
    assert a.run_id != b.run_id or a.subnet != b.subnet
    name = a.ns_name("n11")
    assert NAME_RE.match(name) and NAME_RE.match(a.switch)
    assert len(f"mf{a.run_id}n11") <= 15 and len(f"mf{a.run_id}br") <= 15
    assert a.subnet.startswith("10.")
    with pytest.raises(ClusterError, match="nodes=0"):
        EmulatedNetwork(0)


def test_addresses_sort_like_node_indices():
    """torchrun's c10d rendezvous numbers nodes by their address (as text)."""
    net = EmulatedNetwork(150)
    addresses = [net.node_address(i) for i in range(150)]
    assert sorted(addresses) == addresses and len(set(addresses)) == 150
    with pytest.raises(ClusterError, match="1..150"):
        EmulatedNetwork(151)


def test_spec_validation_and_torchrun_command():
    with pytest.raises(ClusterError, match="--ranks-per-node 0"):
        ClusterSpec(2, 0)
    with pytest.raises(ClusterError, match="--nodes 0"):
        ClusterSpec(0, 2)
    spec = ClusterSpec(3, 2, inter=LinkShape(rate_bps=1e9))
    node = Node(1, "ns", "mfabcdefn1", "10.1.2.101")
    cmd = torchrun_command(spec, node, "10.1.2.100", "abcdef", ["python", "train.py"])
    joined = " ".join(cmd)
    for part in ("--nnodes 3", "--nproc-per-node 2", "--rdzv-backend c10d",
                 "--rdzv-endpoint 10.1.2.100:29400", "--rdzv-conf is_host=false",
                 "--local-addr 10.1.2.101", "--max-restarts 0", "--no-python -- python train.py"):
        assert part in joined
    with pytest.raises(ClusterError, match="--max-restarts -1"):
        ClusterSpec(2, 2, max_restarts=-1)
    restarting = torchrun_command(ClusterSpec(2, 2, max_restarts=3), node, "10.1.2.100",
                                  "abcdef", ["python", "train.py"])
    assert "--max-restarts 3" in " ".join(restarting)
    assert ClusterSpec(2, 2, max_restarts=3).environment(node)[
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    env = spec.environment(node)
    assert env["GLOO_SOCKET_IFNAME"] == "mfabcdefn1"
    assert env["MOEFLOW_CLUSTER_INTER_BW_BPS"] == "1000000000"
    assert "MOEFLOW_CLUSTER_INTRA_BW_BPS" not in env


def test_output_lines_get_global_rank_prefixes():
    out = io.StringIO()
    src = io.BytesIO(b"[n1r0]:hello\n[n1r1]:world\nagent line\n")
    _pump(src, 1, 2, out, threading.Lock())
    assert out.getvalue().splitlines() == ["[n1r2] hello", "[n1r3] world", "[n1] agent line"]


def test_capabilities_parsing():
    assert effective_caps("Name:\tx\nCapEff:\t000001fffeffffff\n") == 0x1fffeffffff
    assert effective_caps("CapEff:\t0000000000000000\n") == 0
