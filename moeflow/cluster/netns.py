"""Emulated nodes: Linux network namespaces joined by shaped veth links (docs/design.md, "Emulated cluster").

Each node is a network namespace with ``lo`` up and one interface carrying the node's address.
Two nodes are joined by one veth pair; more nodes hang off a bridge that lives in its own
namespace (the "switch"), so the host's network namespace is never modified: every link is
created directly inside the run's namespaces. Ranks of one node talk over the namespace's
loopback (traffic to a node's own address is routed over ``lo``); ranks of different nodes over
the shaped link. Each direction of a node's link is shaped on the egress of one veth end.

Names carry the creating process id and a random run id (``mf-<pid>-<hex6>-n<i>`` for
namespaces, ``mf<hex6>n<i>`` / ``mf<hex6>s<i>`` for interfaces, at most 15 characters), and the
addresses come from a random private /24, so concurrent runs never collide;
:func:`cleanup_leftovers` removes the namespaces of runs whose process is gone.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from moeflow.cluster.quota import pid_alive
from moeflow.cluster.shaping import LinkShape

NAME_RE = re.compile(r"^mf-(\d+)-([0-9a-f]{6})-(n\d+|sw)$")
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
MAX_NODES = 150


class ClusterError(RuntimeError):
    """The emulated cluster could not be built, run or removed (message says why and what to do)."""


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def effective_caps(status_text: str | None = None) -> int:
    """The effective capability mask of this process (from /proc/self/status)."""
    if status_text is None:
        with open("/proc/self/status") as f:
            status_text = f.read()
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)$", status_text, re.M)
    return int(m.group(1), 16) if m else 0


def check_privileges(caps: int | None = None) -> None:
    """Refuse clearly unless namespaces and links can be made here (root or the two caps)."""
    missing_tools = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing_tools:
        raise ClusterError(f"the emulated cluster needs the iproute2 tools {missing_tools} on "
                           "PATH (apt-get install iproute2)")
    caps = effective_caps() if caps is None else caps
    missing = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"),
                                      (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")) if not caps >> bit & 1]
    if missing:
        raise ClusterError(
            f"the emulated cluster creates network namespaces and shapes links with tc, which "
            f"needs root (or {' and '.join(missing)}; this process lacks them). Run it as root, "
            "e.g. `sudo -E env PATH=$PATH moeflow cluster run ...`, or on a real cluster start "
            "torchrun on each node yourself")


@dataclass
class Node:
    index: int
    netns: str
    ifname: str        # the node's interface (GLOO_SOCKET_IFNAME)
    address: str


@dataclass
class EmulatedNetwork:
    """``num_nodes`` namespaces joined by links shaped as ``inter``; ``lo`` shaped as ``intra``.

    Use as a context manager: the namespaces exist inside the ``with`` block and are removed
    on the way out, whatever happens (partially built networks included).
    """
    num_nodes: int
    inter: LinkShape = field(default_factory=LinkShape)
    intra: LinkShape = field(default_factory=LinkShape)
    mtu: int = 1500
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))
    nodes: list[Node] = field(default_factory=list, init=False)
    namespaces: list[str] = field(default_factory=list, init=False)

    def __post_init__(self):
        if not 1 <= self.num_nodes <= MAX_NODES:
            raise ClusterError(f"nodes={self.num_nodes} is invalid: pick 1..{MAX_NODES} "
                               "emulated nodes")
        a, b = secrets.randbelow(256), secrets.randbelow(256)
        self.subnet = f"10.{a}.{b}"

    # ---- naming -----------------------------------------------------------------------------
    def ns_name(self, what: str) -> str:
        return f"mf-{os.getpid()}-{self.run_id}-{what}"

    def node_address(self, i: int) -> str:
        """Host parts 100..249 all have 3 digits, so addresses sort (as text) like node
        indices: the order in which torchrun's c10d rendezvous numbers the nodes."""
        return f"{self.subnet}.{100 + i}"

    @property
    def switch(self) -> str:
        return self.ns_name("sw")

    # ---- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        check_privileges()
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _create(self) -> None:
        rid = self.run_id
        for i in range(self.num_nodes):
            ns = self.ns_name(f"n{i}")
            self._add_ns(ns)
            self.nodes.append(Node(i, ns, f"mf{rid}n{i}", self.node_address(i)))
        if self.num_nodes == 2:            # one veth pair, each end shaped (both directions)
            a, b = self.nodes
            _run(["ip", "link", "add", a.ifname, "netns", a.netns, "mtu", str(self.mtu),
                  "type", "veth", "peer", "name", b.ifname, "netns", b.netns,
                  "mtu", str(self.mtu)])
            shaped = [(a.netns, a.ifname), (b.netns, b.ifname)]
        elif self.num_nodes > 2:           # a bridge in its own namespace (the switch)
            self._add_ns(self.switch)
            bridge = f"mf{rid}br"
            _run(["ip", "-n", self.switch, "link", "add", bridge, "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", bridge, "up"])
            shaped = []
            for node in self.nodes:
                port = f"mf{rid}s{node.index}"
                _run(["ip", "link", "add", node.ifname, "netns", node.netns,
                      "mtu", str(self.mtu), "type", "veth", "peer", "name", port,
                      "netns", self.switch, "mtu", str(self.mtu)])
                _run(["ip", "-n", self.switch, "link", "set", port, "master", bridge])
                _run(["ip", "-n", self.switch, "link", "set", port, "up"])
                shaped += [(node.netns, node.ifname), (self.switch, port)]
        else:                              # one node: its address lives on lo
            self.nodes[0].ifname = "lo"
            shaped = []
        for node in self.nodes:
            _run(["ip", "-n", node.netns, "addr", "add", f"{node.address}/24",
                  "dev", node.ifname])
            if node.ifname != "lo":
                _run(["ip", "-n", node.netns, "link", "set", node.ifname, "up"])
        if self.inter.limited:
            for ns, dev in shaped:
                for cmd in self.inter.tc_commands(ns, dev, self.mtu):
                    _tc(cmd)
        if self.intra.limited:
            for node in self.nodes:
                for cmd in self.intra.tc_commands(node.netns, "lo", 65536):
                    _tc(cmd)

    def destroy(self) -> None:
        """Kill every process left in the run's namespaces, then delete them (links go too)."""
        for ns in reversed(self.namespaces):
            remove_namespace(ns)
        self.namespaces.clear()

    def qdiscs(self) -> str:
        """``tc -s qdisc`` of every namespace of the run (to check the shaping is in force)."""
        return "\n".join(f"# {ns}\n" + _run(["tc", "-n", ns, "-s", "qdisc", "show"])
                         for ns in self.namespaces)


def _tc(cmd: list[str]) -> None:
    try:
        _run(cmd)
    except ClusterError as err:
        if "netem" in cmd and "unknown" in str(err).lower():
            raise ClusterError("added latency needs the kernel's netem qdisc "
                               "(CONFIG_NET_SCH_NETEM), which this kernel does not have; run "
                               "without --inter-latency/--intra-latency") from None
        raise


def namespace_pids(ns: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def kill_namespace_processes(ns: str, grace_s: float = 0.0) -> None:
    """SIGTERM (after ``grace_s``: SIGKILL) every process inside namespace ``ns``."""
    pids = namespace_pids(ns)
    sig = signal.SIGTERM if grace_s > 0 else signal.SIGKILL
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    if grace_s > 0:
        deadline = time.monotonic() + grace_s
        while namespace_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.05)
        kill_namespace_processes(ns)


def leftover_namespaces(include_live: bool = False) -> list[str]:
    """Namespaces of emulated runs whose creating process is gone (all of them with include_live)."""
    names = [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]
    out = []
    for name in names:
        m = NAME_RE.match(name)
        if m and (include_live or not pid_alive(int(m.group(1)))):
            out.append(name)
    return out


def cleanup_leftovers(include_live: bool = False) -> list[str]:
    """Remove the namespaces (and the processes and links inside) of dead runs; return their names."""
    check_privileges()
    removed = leftover_namespaces(include_live)
    for ns in removed:
        remove_namespace(ns)
    return removed


def remove_namespace(ns: str) -> None:
    """Kill the processes inside ``ns`` and delete it (its links go with it)."""
    kill_namespace_processes(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
