"""Per-rank CPU quotas: every local rank in a CPU cgroup of its own, held to X cores by a CFS
quota (docs/design.md, "Emulated cluster"; docs/benchmarks/cluster.md, "GPU-like mode").

Implements no paper. It serves the measurements of the papers' claims that rest on load balance
and overlap (HECATE, Parm, ScheMoE; docs/benchmarks/*.md): on a GPU cluster each rank computes on
its own device, so a rank with twice the tokens takes twice as long and the others wait for it.
When ranks share the cores of one machine, a rank blocked in a collective lends its CPU to the
busiest rank and imbalance costs far less. A quota restores the first behaviour.

A quota is a model of a device, not a GPU: a rank held to X cores computes at X cores' speed
whatever the other ranks do. It models neither a GPU's speed nor its memory nor its copy
engines (a rank's compute and its communication still share that rank's quota).

Each rank's group has the quota (the most it may use); the group of all ranks has the largest
CPU weight, so the ranks get their quota even while other processes load the machine (the
quotas of ``auto`` add up to 0.9 of the cores, which leaves the rest at least a tenth).

Layout: ``<root>/moeflow-<launcher pid>-<hex6>/r<rank>``, where ``<root>`` is cgroup v1's cpu
controller (``cpu.cfs_quota_us``, ``cpu.cfs_period_us``) or the cgroup v2 hierarchy with the cpu
controller (``cpu.max``). Each rank moves itself into ``r<RANK>`` when it starts; ranks in an
emulated node reach the hierarchy through ``/proc/<launcher pid>/root``, because ``ip netns
exec`` mounts a fresh ``/sys`` that hides the cgroup file system. The launcher removes the
groups when its ranks are gone; :func:`cleanup_stale` removes those of launchers that died.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass, field

from moeflow.errors import ConfigError

V1_ROOT = "/sys/fs/cgroup/cpu"
V2_ROOT = "/sys/fs/cgroup"
GROUP_RE = re.compile(r"^moeflow-(\d+)-([0-9a-f]{6})$")
MAX_PERIOD_US = 10_000      # throttling then adds at most ~10 ms to a step, far below one
MIN_QUOTA_US = 1_000        # the kernel's floor for cpu.cfs_quota_us / cpu.max
V1_MAX_SHARES = 262_144     # the largest cpu.shares (v1) / cpu.weight (v2): the kernel's cap
V2_MAX_WEIGHT = 10_000
IN_FORCE_ENV = "MOEFLOW_CPU_PER_RANK"   # provenance the launchers hand the ranks (never read
                                        # as a switch: results record it, see in_force)
FLAG = "--cpu-per-rank"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                                  # not Linux
        return os.cpu_count() or 1


def parse_cpu_per_rank(text: str | float | None, ranks: int) -> float | None:
    """``--cpu-per-rank`` -> cores per rank: a number, ``auto`` (0.9 x cores / ranks, rounded
    to 0.01 core) or ``none`` (None: the ranks share the cores)."""
    if text is None or isinstance(text, (int, float)) and not isinstance(text, bool):
        return None if text is None else float(text)
    word = str(text).strip().lower()
    if word in ("none", "off", ""):
        return None
    if word == "auto":
        return math.floor(90 * usable_cores() / max(ranks, 1)) / 100
    try:
        return float(word)
    except ValueError:
        raise ConfigError(f"{FLAG}={text!r} is invalid: give cores per rank (e.g. 0.45), auto "
                          "(0.9 x cores / ranks) or none (ranks share the cores)") from None


@dataclass(frozen=True)
class CpuQuota:
    """How much CPU each rank gets. ``cpu_per_rank``: cores (None: no quota, the ranks share
    the cores); ``period_us``: the CFS period (<= 10 ms); ``cgroup_root``: the hierarchy to
    create the groups in (None: cgroup v1's ``/sys/fs/cgroup/cpu``, else v2's
    ``/sys/fs/cgroup``)."""
    cpu_per_rank: float | None = None
    period_us: int = MAX_PERIOD_US
    cgroup_root: str | None = None

    def __post_init__(self):
        if isinstance(self.period_us, bool) or not isinstance(self.period_us, int) \
                or not MIN_QUOTA_US <= self.period_us <= MAX_PERIOD_US:
            raise ConfigError(f"period_us={self.period_us!r} is invalid: the CFS period must be "
                              f"an integer in {MIN_QUOTA_US}..{MAX_PERIOD_US} us (short periods "
                              "keep throttling far below a step)")
        x = self.cpu_per_rank
        if x is None:
            return
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) \
                or x <= 0:
            raise ConfigError(f"{FLAG} {x!r} is invalid: give a positive number of cores per "
                              "rank (e.g. 0.45), auto or none")
        if x * self.period_us < MIN_QUOTA_US:
            raise ConfigError(f"{FLAG} {x:g} is invalid: below {MIN_QUOTA_US / self.period_us:g}"
                              f" core the quota per {self.period_us} us period falls under the "
                              f"kernel's {MIN_QUOTA_US} us minimum; give more cores per rank")
        if x > usable_cores():
            raise ConfigError(f"{FLAG} {x:g} is invalid: this machine lets the ranks use "
                              f"{usable_cores()} core(s); give at most that (auto: 0.9 x cores "
                              "/ ranks)")

    @property
    def enabled(self) -> bool:
        return self.cpu_per_rank is not None

    @property
    def quota_us(self) -> int:
        assert self.cpu_per_rank is not None
        return round(self.cpu_per_rank * self.period_us)

    @property
    def threads(self) -> int:
        """Torch threads per rank: ceil(cores), at least 1."""
        assert self.cpu_per_rank is not None
        return max(1, math.ceil(self.cpu_per_rank - 1e-9))

    def oversubscribed(self, ranks: int) -> str | None:
        """A warning when ``ranks`` quotas add up to more cores than there are (each rank is
        then no longer sure of its share), else None."""
        if self.cpu_per_rank is None or self.cpu_per_rank * ranks <= usable_cores() + 1e-9:
            return None
        return (f"warning: {FLAG} {self.cpu_per_rank:g} x {ranks} ranks = "
                f"{self.cpu_per_rank * ranks:g} cores, more than the {usable_cores()} here: "
                "ranks will not get their share (auto = 0.9 x cores / ranks)")


def _refuse(quota: CpuQuota, why: str) -> ConfigError:
    return ConfigError(
        f"{FLAG} {quota.cpu_per_rank:g} needs a writable CPU cgroup hierarchy, and {why}. Run "
        f"as root with the cgroup file system mounted (cgroup v1's cpu controller at {V1_ROOT}, "
        f"or cgroup v2 at {V2_ROOT} with 'cpu' in cgroup.controllers), or leave out {FLAG} "
        "(the ranks then share the cores)")


def detect(root: str | None = None) -> tuple[str, int] | None:
    """``(hierarchy, version)`` of the CPU controller at ``root`` (None: look at the usual
    places), or None when there is none."""
    for path in ([root] if root is not None else [V1_ROOT, V2_ROOT]):
        if os.path.isfile(os.path.join(path, "cpu.cfs_quota_us")):
            return path, 1
        try:
            with open(os.path.join(path, "cgroup.controllers")) as f:
                if "cpu" in f.read().split():
                    return path, 2
        except OSError:
            pass
    return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _pids(group: str) -> list[int]:
    try:
        with open(os.path.join(group, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _remove_group(path: str, parent: str, wait_s: float = 5.0) -> None:
    """Remove a cgroup and its children; processes still inside (ranks that are exiting) are
    waited for, then moved to ``parent`` (a cgroup with processes cannot be removed)."""
    for name in sorted(os.listdir(path)):
        child = os.path.join(path, name)
        if os.path.isdir(child):
            _remove_group(child, parent, wait_s)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise
        if time.monotonic() > deadline - wait_s / 2:      # half the wait gone: move them out
            for pid in _pids(path):
                try:
                    _write(os.path.join(parent, "cgroup.procs"), str(pid))
                except OSError:
                    pass                                      # already gone
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a launcher whose stale groups or namespaces are left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(include_live: bool = False, root: str | None = None) -> list[str]:
    """Remove the rank groups of launchers that died (with ``include_live``: all of them);
    return their paths. Nothing to do where there is no CPU cgroup hierarchy."""
    found = detect(root)
    if found is None:
        return []
    hierarchy, _ = found
    removed = []
    for name in sorted(os.listdir(hierarchy)):
        m = GROUP_RE.match(name)
        if m and (include_live or not pid_alive(int(m.group(1)))):
            path = os.path.join(hierarchy, name)
            _remove_group(path, hierarchy)
            removed.append(path)
    return removed


def leftover_groups(root: str | None = None) -> list[str]:
    """Every moeflow rank group present now (live launchers' included)."""
    found = detect(root)
    if found is None:
        return []
    return sorted(os.path.join(found[0], n) for n in os.listdir(found[0]) if GROUP_RE.match(n))


@dataclass
class RankCgroups:
    """``ranks`` CPU cgroups, one per rank, each with ``quota``'s CFS limit.

    Use as a context manager (or :meth:`create` / :meth:`destroy` in try/finally): the groups
    exist inside the block and are removed on the way out, whatever happens. :meth:`create`
    first removes the groups of launchers that died, and refuses clearly (naming
    ``--cpu-per-rank``) when the hierarchy is missing or not writable.
    """
    quota: CpuQuota
    ranks: int
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))
    path: str | None = field(default=None, init=False)
    version: int | None = field(default=None, init=False)
    hierarchy: str | None = field(default=None, init=False)

    def __enter__(self) -> "RankCgroups":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        if not self.quota.enabled:
            raise ConfigError(f"{FLAG} is none: there is no quota to create groups for")
        if self.ranks < 1:
            raise ConfigError(f"ranks={self.ranks} is invalid: need at least one rank")
        found = detect(self.quota.cgroup_root)
        if found is None:
            where = self.quota.cgroup_root or f"{V1_ROOT} or {V2_ROOT}"
            raise _refuse(self.quota, f"{where} has no CPU controller (no cpu.cfs_quota_us, "
                                      "no 'cpu' in cgroup.controllers)")
        self.hierarchy, self.version = found
        try:
            cleanup_stale(root=self.hierarchy)
        except OSError as err:             # a group we cannot remove must not block this run
            print(f"moeflow: a CPU cgroup of a dead launcher could not be removed ({err})",
                  file=sys.stderr)
        path = os.path.join(self.hierarchy, f"moeflow-{os.getpid()}-{self.run_id}")
        try:
            os.mkdir(path)
        except OSError as err:
            raise _refuse(self.quota, f"creating {path} failed: {err.strerror}") from None
        self.path = path
        try:
            self._configure()
        except OSError as err:
            self.destroy()
            raise _refuse(self.quota, f"configuring {path} failed: {err}") from None
        except BaseException:
            self.destroy()
            raise

    def _configure(self) -> None:
        assert self.path is not None and self.hierarchy is not None
        if self.version == 2:          # let the cpu controller reach the rank groups
            for parent in (self.hierarchy, self.path):
                try:
                    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                        on = f.read().split()
                except FileNotFoundError:
                    on = []
                if "cpu" not in on:
                    _write(os.path.join(parent, "cgroup.subtree_control"), "+cpu")
        # the quota caps a rank; the weight makes sure it gets that much when other processes
        # load the machine (a device of its own is never busy with someone else's work)
        if self.version == 1:
            _write(os.path.join(self.path, "cpu.shares"), str(V1_MAX_SHARES))
        else:
            _write(os.path.join(self.path, "cpu.weight"), str(V2_MAX_WEIGHT))
        q = self.quota
        for rank in range(self.ranks):
            group = self.rank_path(rank)
            os.mkdir(group)
            if self.version == 1:
                _write(os.path.join(group, "cpu.cfs_period_us"), str(q.period_us))
                _write(os.path.join(group, "cpu.cfs_quota_us"), str(q.quota_us))
            else:
                _write(os.path.join(group, "cpu.max"), f"{q.quota_us} {q.period_us}")

    def rank_path(self, rank: int, via_proc: bool = False) -> str:
        """Rank ``rank``'s group; ``via_proc``: as reached from any mount namespace (inside
        ``ip netns exec``), through this launcher's root."""
        assert self.path is not None, "create() first"
        path = os.path.join(self.path, f"r{rank}")
        return f"/proc/{os.getpid()}/root{path}" if via_proc else path

    def destroy(self) -> None:
        if self.path is None:
            return
        try:
            _remove_group(self.path, self.hierarchy)
        except OSError as err:
            print(f"moeflow: could not remove the CPU cgroup {self.path} ({err}); "
                  "`moeflow cluster cleanup` removes it once this launcher has exited",
                  file=sys.stderr)
        self.path = None

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` as a rank started by torchrun in an emulated node runs it: the shell
        moves itself (the rank's process, kept by ``exec``) into ``r<RANK>`` and sets the
        rank's thread count before it starts the command."""
        base = self.rank_path(0, via_proc=True)[:-len("/r0")]
        # the shell's own pid read from /proc/self/stat, not "$$": torchrun passes each
        # argument through string.Template, which turns "$$" into "$"
        script = ('read -r pid _ < /proc/self/stat && echo "$pid" > "$0/r$RANK/cgroup.procs" '
                  '|| { echo "moeflow: rank $RANK could not join its CPU cgroup $0/r$RANK" >&2; '
                  'exit 97; }; '
                  f'export OMP_NUM_THREADS={self.quota.threads} '
                  f'{IN_FORCE_ENV}={self.quota.cpu_per_rank!r}; exec "$@"')
        return ["/bin/sh", "-c", script, base, *command]


def join(group: str) -> None:
    """Move this process (all its threads) into the cgroup ``group`` (a rank's own)."""
    try:
        _write(os.path.join(group, "cgroup.procs"), str(os.getpid()))
    except OSError as err:
        raise ConfigError(f"{FLAG}: this rank could not join its CPU cgroup {group} ({err}); "
                          "run as root or leave out --cpu-per-rank") from None


def in_force(declared: float | None = None) -> float | None:
    """The cores per rank in force for this job, for its result files: what the launcher
    that started this rank handed it (``moeflow cluster run --cpu-per-rank``, or local ranks
    started with a quota), else ``declared`` (the quota this process starts its ranks with)."""
    text = os.environ.get(IN_FORCE_ENV)
    return float(text) if text else declared
