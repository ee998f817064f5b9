"""Per-rank CPU quotas (the GPU-like mode) on the real cgroup hierarchy: a quota'd rank computes
at its share, a rank with twice the work makes the step twice as long only with quotas, ranks of
``moeflow cluster run --cpu-per-rank`` sit in their groups with their thread count, every group
is removed (after success, Ctrl-C, kill -9 + ``moeflow cluster cleanup``), and a read-only
hierarchy is refused naming the flag.

Needs root and a CPU cgroup hierarchy (v1 cpu controller or v2 with cpu); skips otherwise.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import pytest

from moeflow.cluster.quota import CpuQuota, RankCgroups, detect, leftover_groups
from moeflow.config import ConfigError
from moeflow.launch import launch_local
from tests.cluster import quota_work

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "not root: CPU cgroups cannot be created"
    if detect() is None:
        return "no CPU cgroup hierarchy (cgroup v1 cpu controller or v2 with cpu) mounted"
    try:
        with RankCgroups(CpuQuota(0.5), 1):
            pass
    except ConfigError as err:
        return str(err)
    return None


_WHY = _why_not()
pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(_WHY is not None, reason=f"no CPU cgroups here: {_WHY}")]


def _groups_of(pid: int) -> list[str]:
    return [g for g in leftover_groups() if os.path.basename(g).startswith(f"moeflow-{pid}-")]


def _one_core_rate(n: int) -> float:
    return max(quota_work.cpu_rate(n) for _ in range(3))


@pytest.mark.multirank
def test_quota_rank_computes_at_its_share():
    n = max(200_000, int(_one_core_rate(500_000) * 0.25))     # ~0.25 s of one core
    full = _one_core_rate(n)                  # the same loop, unquota'd, per second of a core
    res = launch_local(quota_work.rate_worker, 1, n, 4, quota=CpuQuota(0.5))[0]
    share = res["rate"] / full
    assert 0.5 * 0.8 <= share <= 0.5 * 1.2, f"rank at {share:.2f} core with a 0.5 quota"
    assert re.search(r"cpu[^:]*:/moeflow-\d+-[0-9a-f]{6}/r0$", res["cgroup"], re.M), res["cgroup"]
    assert res["threads"] == 1 and res["in_force"] == "0.5"
    assert not _groups_of(os.getpid())


@pytest.mark.slow
@pytest.mark.multirank
def test_twice_the_work_twice_the_step_only_with_quotas():
    """Two ranks on one core (more ranks than cores, as 4-8 ranks on this 2-core machine);
    rank 1 does twice rank 0's work. With 0.45 core each the light rank's step (its wait
    included) is ~2x its own compute, as on separate devices; sharing the core, the light rank's
    idle time goes to the heavy one and the step is ~1.5x."""
    core = sorted(os.sched_getaffinity(0))[0]
    n = max(100_000, int(_one_core_rate(500_000) * 0.15))     # ~0.15 s of a core, light rank

    def ratio(quota: CpuQuota) -> float:
        res = launch_local(quota_work.step_worker, 2, n, 5, core, quota=quota)
        return statistics.median(step / own for own, step in res[0])

    with_q, without = [], []
    for _ in range(2):                                         # interleaved
        with_q.append(ratio(CpuQuota(0.45)))
        without.append(ratio(CpuQuota()))
    q, s = statistics.median(with_q), statistics.median(without)
    assert 1.6 <= q <= 2.5, f"with quotas the step is {q:.2f}x the light rank's compute"
    assert s < 0.92 * q, f"shared core {s:.2f}x vs quota'd {q:.2f}x: imbalance no cheaper"
    assert not _groups_of(os.getpid())


@pytest.mark.multirank
def test_cluster_run_ranks_in_their_groups_and_removed():
    code = ("import os, torch; print('Q', open('/proc/self/cgroup').read().split('cpu:')[1]"
            ".split()[0], torch.get_num_threads(), os.environ['MOEFLOW_CPU_PER_RANK'])")
    proc = subprocess.Popen([sys.executable, "-m", "moeflow.cli", "cluster", "run", "--nodes",
                             "2", "--ranks-per-node", "1", "--cpu-per-rank", "1.5", "--",
                             sys.executable, "-c", code], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    for rank in range(2):
        assert re.search(rf"^\[n{rank}r{rank}\] Q /moeflow-{proc.pid}-[0-9a-f]{{6}}/r{rank} 2 1.5$",
                         out, re.M), out
    assert not _groups_of(proc.pid)


def test_ctrl_c_removes_the_groups():
    marker = f"moeflow-test-quota-sigint-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-m", "moeflow.cli", "cluster", "run", "--nodes", "1",
                             "--ranks-per-node", "2", "--cpu-per-rank", "0.4", "--",
                             sys.executable, "-c", f"import time; time.sleep(120)  # {marker}"],
                            env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            groups = _groups_of(proc.pid)
            if groups and all(_procs(os.path.join(groups[0], f"r{r}")) for r in range(2)):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the ranks never joined their groups")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, out
    assert not _groups_of(proc.pid)


def _procs(group: str) -> list[int]:
    try:
        with open(os.path.join(group, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


@pytest.mark.slow          # the crash path: test_cleanup_removes_groups_of_a_killed_launcher; normal exit: test_cluster_run_ranks_in_their_groups_and_removed
def test_local_launch_interrupted_removes_the_groups():
    holder = subprocess.Popen(
        [sys.executable, "-c", "from moeflow.cluster.quota import CpuQuota\n"
         "from moeflow.launch import launch_local\nfrom tests.cluster import quota_work\n"
         "launch_local(quota_work.sleep_worker, 2, 120.0, quota=CpuQuota(0.4))"],
        env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            groups = _groups_of(holder.pid)
            if groups and all(_procs(os.path.join(groups[0], f"r{r}")) for r in range(2)):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the ranks never joined their groups")
        holder.send_signal(signal.SIGINT)
        holder.communicate(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert holder.returncode != 0
    assert not _groups_of(holder.pid)


def test_cleanup_removes_groups_of_a_killed_launcher():
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom moeflow.cluster.quota import CpuQuota, "
         "RankCgroups\ng = RankCgroups(CpuQuota(0.3), 3); g.create(); print('up', flush=True); "
         "time.sleep(60)"], env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        left = _groups_of(holder.pid)
        assert len(left) == 1 and sorted(os.listdir(left[0])).count("r2") == 1
        with open(os.path.join(left[0], "r1", "cpu.cfs_quota_us" if detect()[1] == 1
                               else "cpu.max")) as f:
            assert f.read().split()[0] == "3000"          # 0.3 core of a 10 ms period
        run = [sys.executable, "-m", "moeflow.cli", "cluster", "cleanup"]
        subprocess.run(run, env=ENV, cwd=ROOT, capture_output=True, timeout=60, check=True)
        assert _groups_of(holder.pid) == left                # its launcher is alive: kept
        holder.kill()                                        # kill -9: no clean-up ran
        holder.wait()
        out = subprocess.run(run, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and left[0] in out.stdout, out.stdout
        assert not _groups_of(holder.pid)
    finally:
        if holder.poll() is None:
            holder.kill()


def test_read_only_hierarchy_is_refused():
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", tmp], check=True)
        try:
            open(os.path.join(tmp, "cpu.cfs_quota_us"), "w").close()
            subprocess.run(["mount", "-o", "remount,ro", tmp], check=True)
            with pytest.raises(ConfigError, match=r"--cpu-per-rank 0.5 needs a writable CPU "
                                                  r"cgroup.*creating .* failed.*leave out "
                                                  r"--cpu-per-rank"):
                RankCgroups(CpuQuota(0.5, cgroup_root=tmp), 2).create()
        finally:
            subprocess.run(["umount", tmp], check=True)
