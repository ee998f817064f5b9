"""``moeflow cluster run``: torchrun in every emulated node, output streamed, everything removed after.

For node ``i`` of ``N`` the launcher starts, inside that node's namespace,
``python -m torch.distributed.run --nnodes N --nproc-per-node M --rdzv-backend c10d
--rdzv-endpoint <node 0>:29400 --rdzv-conf is_host=false --local-addr <node i's address>
--max-restarts R --no-python COMMAND...`` (R: ``--max-restarts``, default 0; torch's agents
restart every rank of the job after a failure, ``moeflow train`` resumes from its checkpoint) with ``GLOO_SOCKET_IFNAME`` set to the node's
interface. The rendezvous store is a separate process in node 0's namespace that outlives every
agent (with torchrun's static rendezvous, node 0's agent hosts the store and may exit while the
others still wait in torchrun's exit barrier, which they report with a stack trace). The c10d
rendezvous orders nodes by their address, and node addresses sort like node indices, so node
``i`` holds global ranks ``i*M .. i*M+M-1``, the numbering :class:`~moeflow.topology.Topology`
assumes (the tests check it). Lines of every rank are printed as ``[n<node>r<rank>] ...``.

With a :class:`~moeflow.cluster.quota.CpuQuota` (``--cpu-per-rank``) every rank runs in a CPU
cgroup of its own, held to its share of the cores (:mod:`moeflow.cluster.quota`); the groups are
removed with the namespaces.

The job's exit status is the first non-zero status of a node (0 when all succeed). When a node
fails, the others are stopped at once (their ranks would otherwise wait for a collective
timeout). SIGINT/SIGTERM/SIGHUP stop every node; the namespaces, links and every process inside
them are removed in all cases.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

from moeflow.cluster.netns import ClusterError, EmulatedNetwork, kill_namespace_processes
from moeflow.cluster.quota import CpuQuota, RankCgroups
from moeflow.cluster.shaping import LinkShape

STORE_PORT = 29400           # free by construction: node 0's namespace is new
STORE = ("import signal, sys\n"
         "from torch.distributed import TCPStore\n"
         "store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, "
         "wait_for_workers=False)\n"
         "signal.pause()\n")


@dataclass
class ClusterSpec:
    nodes: int
    ranks_per_node: int
    inter: LinkShape = field(default_factory=LinkShape)
    intra: LinkShape = field(default_factory=LinkShape)
    mtu: int = 1500
    max_restarts: int = 0         # torchrun's --max-restarts (restarts of the ranks on failure)
    quota: CpuQuota = field(default_factory=CpuQuota)   # cores per rank (None: shared cores)

    def __post_init__(self):
        if self.nodes < 1:
            raise ClusterError(f"--nodes {self.nodes} is invalid: need at least one node")
        if self.ranks_per_node < 1:
            raise ClusterError(f"--ranks-per-node {self.ranks_per_node} is invalid: need at "
                               "least one rank per node")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) \
                or self.max_restarts < 0:
            raise ClusterError(f"--max-restarts {self.max_restarts} is invalid: must be an "
                               "integer >= 0 (0: a failed rank ends the job)")
        if not isinstance(self.quota, CpuQuota):
            raise ClusterError(f"quota={self.quota!r} is invalid: give a CpuQuota")
        if not 576 <= self.mtu <= 65535:
            raise ClusterError(f"--mtu {self.mtu} is invalid: pick 576..65535 (1500 = Ethernet)")

    def environment(self, node) -> dict[str, str]:
        """What a rank in ``node`` gets in its environment on top of the caller's."""
        env = {"GLOO_SOCKET_IFNAME": node.ifname, "MOEFLOW_CLUSTER_NODES": str(self.nodes)}
        if self.max_restarts:
            # a fresh store for each attempt's ranks (moeflow.launch.launch_local says why)
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        for name, shape in (("INTER", self.inter), ("INTRA", self.intra)):
            if shape.rate_bps is not None:
                env[f"MOEFLOW_CLUSTER_{name}_BW_BPS"] = f"{shape.rate_bps:.0f}"
            if shape.latency_s:
                env[f"MOEFLOW_CLUSTER_{name}_LATENCY_S"] = repr(shape.latency_s)
        return env


def torchrun_command(spec: ClusterSpec, node, master: str, run_id: str,
                     command: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(spec.nodes),
            "--nproc-per-node", str(spec.ranks_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{master}:{STORE_PORT}", "--rdzv-id", f"moeflow-{run_id}",
            "--rdzv-conf", "is_host=false", "--local-addr", node.address,
            "--max-restarts", str(spec.max_restarts), "--monitor-interval", "0.2", "--role", f"n{node.index}r",
            # "--": torchrun's argparse must not read the command's own options
            # (prefix matching would take e.g. "--r" for one of its options)
            "--tee", "3", "--no-python", "--", *command]


def _pump(stream, node: int, ranks_per_node: int, out: TextIO, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, torchrun's ``[n<i>r<local>]:`` made global."""
    prefix_local = f"[n{node}r"
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if line.startswith(prefix_local):           # "[n1r0]:..." -> "[n1r2] ..."
            head, sep, rest = line.partition("]:")
            local = head[len(prefix_local):]
            if sep and local.isdigit():
                line = f"[n{node}r{node * ranks_per_node + int(local)}] {rest}"
            else:
                line = f"[n{node}] {line}"
        else:
            line = f"[n{node}] {line}"
        with lock:
            out.write(line)
            out.flush()
    stream.close()


def run_cluster(spec: ClusterSpec, command: list[str], out: TextIO | None = None,
                grace_s: float = 5.0) -> int:
    """Run ``command`` as a torchrun job over ``spec``'s emulated nodes; return its exit status."""
    if not command:
        raise ClusterError("no command to run: write it after `--`, e.g. "
                           "`moeflow cluster run --nodes 2 -- python -m moeflow.cli bench links`")
    out = out or sys.stdout
    lock = threading.Lock()
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    in_main = threading.current_thread() is threading.main_thread()
    old = {}
    if in_main:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[s] = signal.signal(s, on_signal)
    procs: list[subprocess.Popen] = []
    store = None
    pumps: list[threading.Thread] = []
    net = EmulatedNetwork(spec.nodes, spec.inter, spec.intra, mtu=spec.mtu)
    groups = RankCgroups(spec.quota, spec.nodes * spec.ranks_per_node) \
        if spec.quota.enabled else None
    try:
        if groups is not None:
            groups.create()           # refuses (ConfigError) before any namespace exists
            command = groups.wrap(command)
            warning = spec.quota.oversubscribed(spec.nodes * spec.ranks_per_node)
            if warning:
                out.write(f"moeflow cluster: {warning}\n")
        net.create()
        master = net.nodes[0].address
        store = subprocess.Popen(["ip", "netns", "exec", net.nodes[0].netns, sys.executable,
                                  "-c", STORE, master, str(STORE_PORT)],
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        for node in net.nodes:
            env = dict(os.environ, **spec.environment(node))
            argv = ["ip", "netns", "exec", node.netns,
                    *torchrun_command(spec, node, master, net.run_id, command)]
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            procs.append(proc)
            t = threading.Thread(target=_pump, args=(proc.stdout, node.index,
                                                     spec.ranks_per_node, out, lock),
                                 daemon=True)
            t.start()
            pumps.append(t)
        status = 0
        while not stop.is_set():
            if store.poll() is not None:
                raise ClusterError(f"the rendezvous store in node 0 exited with status "
                                   f"{store.returncode} before the job ended")
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                status = failed[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
        if received:
            status = 128 + received[0]
            with lock:
                out.write(f"moeflow cluster: got signal {received[0]}, stopping every node\n")
        elif status:
            with lock:
                out.write(f"moeflow cluster: a node exited with status {status}; "
                          "stopping the others\n")
        return status
    finally:
        for node, proc in zip(net.nodes, procs):
            if proc.poll() is None:
                kill_namespace_processes(node.netns, grace_s=grace_s)
        for proc in procs:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for t in pumps:
            t.join(timeout=grace_s)
        net.destroy()                     # also kills the store and anything left inside
        if store is not None:
            store.wait()
        if groups is not None:
            groups.destroy()              # every rank is gone: the groups are empty
        for s, handler in old.items():
            signal.signal(s, handler)
