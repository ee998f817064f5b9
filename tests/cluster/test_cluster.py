"""The emulated cluster: nodes reachable, rate limit in force, topology and float64 parity inside
emulated nodes, clean-up after success / a killed rank / Ctrl-C, refusal without privileges.

Needs root (network namespaces); every test skips with the reason where they cannot be made.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from moeflow.cluster import ClusterError, EmulatedNetwork, LinkShape, check_privileges
from moeflow.cluster.netns import NAME_RE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _can_make_namespaces() -> str | None:
    try:
        with EmulatedNetwork(1):
            pass
    except (ClusterError, OSError) as err:
        return str(err)
    return None


_WHY = _can_make_namespaces()
needs_netns = pytest.mark.skipif(_WHY is not None, reason=f"no network namespaces here: {_WHY}")
pytestmark = pytest.mark.cluster


def _our_namespaces(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if line and (m := NAME_RE.match(line.split()[0])) and int(m.group(1)) == pid]


def _host_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def _procs_with(marker: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


def _ranks_with(marker: str) -> list[int]:
    """Rank processes (``python -c <script with marker>``), not the launcher nor torchrun."""
    out = []
    for pid in _procs_with(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[1] == b"-c":
            out.append(pid)
    return sorted(out)


def _cluster(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moeflow.cli", "cluster", "run", *args],
                            env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)


# ---- the network itself ---------------------------------------------------------------------
SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5001)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], 5001), timeout=10)
c.sendall(b"x" * int(sys.argv[2])); c.close()
"""


def _transfer(net: EmulatedNetwork, src: int, dst: int, nbytes: int) -> float:
    """Seconds to move ``nbytes`` over TCP from node ``src`` to node ``dst`` (server side)."""
    a, b = net.nodes[src], net.nodes[dst]
    server = subprocess.Popen(["ip", "netns", "exec", b.netns, sys.executable, "-c", SERVER,
                               b.address], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        subprocess.run(["ip", "netns", "exec", a.netns, sys.executable, "-c", CLIENT,
                        b.address, str(nbytes)], check=True, timeout=60)
        n, seconds = server.stdout.readline().split()
        assert int(n) == nbytes
        return float(seconds)
    finally:
        server.kill()
        server.wait()


@needs_netns
def test_nodes_reachable_rate_limited_and_removed():
    before = _host_links()
    rate = 40e6                                           # 40 Mbit/s: 1 MB takes ~0.2 s
    with EmulatedNetwork(3, inter=LinkShape(rate_bps=rate)) as net:
        names = list(net.namespaces)
        assert len(names) == 4 and net.switch in names    # 3 nodes + the switch
        qd = net.qdiscs()
        assert qd.count("tbf") == 6 and "rate 40Mbit" in qd   # both ends of 3 links
        for src, dst in ((0, 1), (1, 2), (2, 0)):
            nbytes = 1 << 20
            seconds = _transfer(net, src, dst, nbytes)
            mbit = nbytes * 8 / seconds / 1e6
            # the limit is in force (tbf counts headers: goodput a bit below 40) and the
            # link is not broken (a loaded CPU slows it, never to a tenth)
            assert 4 < mbit <= 40 * 1.05, f"{src}->{dst}: {mbit:.1f} Mbit/s at 40 Mbit/s"
        loopback = _transfer_same_node(net)
        assert loopback > 10 * 40, f"loopback {loopback:.0f} Mbit/s is not much faster"
    assert not [n for n in names if n in _our_namespaces(os.getpid())]
    assert _host_links() == before                        # the host namespace was not touched


def _transfer_same_node(net: EmulatedNetwork) -> float:
    """Mbit/s between two processes of node 0 over its own address (takes loopback)."""
    a = net.nodes[0]
    server = subprocess.Popen(["ip", "netns", "exec", a.netns, sys.executable, "-c", SERVER,
                               a.address], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        nbytes = 32 << 20
        subprocess.run(["ip", "netns", "exec", a.netns, sys.executable, "-c", CLIENT,
                        a.address, str(nbytes)], check=True, timeout=60)
        n, seconds = server.stdout.readline().split()
        return nbytes * 8 / float(seconds) / 1e6
    finally:
        server.kill()
        server.wait()


def test_refuses_without_privileges_in_process():
    with pytest.raises(ClusterError, match="needs root.*CAP_NET_ADMIN and CAP_SYS_ADMIN"):
        check_privileges(caps=0)
    check_privileges(caps=(1 << 12) | (1 << 21))


@needs_netns
def test_cli_refuses_without_privileges():
    proc = subprocess.run(
        ["setpriv", "--bounding-set", "-net_admin,-sys_admin", "--inh-caps",
         "-net_admin,-sys_admin", sys.executable, "-m", "moeflow.cli", "cluster", "run",
         "--nodes", "2", "--", "true"], env=ENV, cwd=ROOT, capture_output=True, text=True,
        timeout=60)
    assert proc.returncode != 0
    assert "needs root" in proc.stderr and "CAP_NET_ADMIN" in proc.stderr, proc.stderr


# ---- jobs on the emulated cluster -------------------------------------------------------------
@needs_netns
@pytest.mark.multirank
def test_topology_and_float64_parity_across_two_nodes():
    proc = _cluster(["--nodes", "2", "--ranks-per-node", "2", "--inter-bw", "1gbit", "--",
                     sys.executable, "-m", "tests.helpers.cluster_parity"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    for rank in range(4):
        node, local = divmod(rank, 2)
        assert re.search(rf"^\[n{node}r{rank}\] TOPO {rank} 2 {node} {local} mf[0-9a-f]{{6}}n{node}$",
                         out, re.M), out
        assert re.search(rf"^\[n{node}r{rank}\] PARITY OK \d+ cases$", out, re.M), out
    links = re.search(r"^\[n0r0\] LINKS (.*)$", out, re.M).group(1).split()
    assert links == [f"{g}/{op}/{n}" for g, n in (("intra", 2), ("inter", 2), ("world", 4))
                     for op in ("p2p", "all_to_all", "all_gather", "reduce_scatter",
                                "all_reduce") if not (g == "world" and op == "p2p")]
    assert not _our_namespaces(proc.pid)


@needs_netns
def test_killed_rank_fails_the_job_and_cleans_up():
    marker = f"moeflow-test-kill-{os.getpid()}"
    script = ("import os, time, sys; r = int(os.environ['RANK']); "
              f"print('started', r, flush=True); time.sleep(120)  # {marker}")
    proc = _cluster(["--nodes", "2", "--ranks-per-node", "2", "--", sys.executable, "-c",
                     script])
    try:
        deadline = time.monotonic() + 120
        while len(_ranks_with(marker)) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        victims = _ranks_with(marker)
        assert len(victims) == 4, "ranks did not start"
        time.sleep(1.0)
        os.kill(victims[-1], signal.SIGKILL)            # one rank dies
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out
    assert not _procs_with(marker), "ranks left running"
    assert not _our_namespaces(proc.pid)


@pytest.mark.slow          # cleanup after a failure: test_killed_rank_fails_the_job_and_cleans_up
@needs_netns
def test_ctrl_c_stops_every_node_and_cleans_up():
    marker = f"moeflow-test-sigint-{os.getpid()}"
    proc = _cluster(["--nodes", "3", "--ranks-per-node", "1", "--", sys.executable, "-c",
                     f"import time; time.sleep(120)  # {marker}"])
    try:
        deadline = time.monotonic() + 120
        while len(_ranks_with(marker)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _our_namespaces(proc.pid), "namespaces were not made"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "got signal" in out
    assert not _procs_with(marker), "ranks left running"
    assert not _our_namespaces(proc.pid)


@needs_netns
def test_cleanup_removes_what_a_killed_launcher_left():
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from moeflow.cluster import EmulatedNetwork\n"
         "net = EmulatedNetwork(3); net.create(); print('up', flush=True); time.sleep(60)"],
        env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        left = _our_namespaces(holder.pid)
        assert len(left) == 4
        out = subprocess.run([sys.executable, "-m", "moeflow.cli", "cluster", "cleanup"],
                             env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert _our_namespaces(holder.pid) == left       # its launcher is alive: kept
        holder.kill()                                    # kill -9: no clean-up ran
        holder.wait()
        out = subprocess.run([sys.executable, "-m", "moeflow.cli", "cluster", "cleanup"],
                             env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and all(n in out.stdout for n in left), out.stdout
        assert not _our_namespaces(holder.pid)
    finally:
        if holder.poll() is None:
            holder.kill()
        for ns in _our_namespaces(holder.pid):
            subprocess.run(["ip", "netns", "del", ns])


@needs_netns
def test_latency_uses_netem_or_is_refused_clearly():
    shape = LinkShape(rate_bps=1e9, latency_s=1e-3)
    try:
        with EmulatedNetwork(2, inter=shape) as net:
            qd = net.qdiscs()
            names = list(net.namespaces)
    except ClusterError as err:                     # kernels without netem (this project's)
        assert "netem" in str(err) and "--inter-latency" in str(err)
        assert not _our_namespaces(os.getpid())
        return
    assert qd.count("netem") == 2 and qd.count("tbf") == 2 and "delay 1ms" in qd
    assert not [n for n in names if n in _our_namespaces(os.getpid())]
