"""Per-rank CPU quotas without privileges: the flag's values, the dataclass's checks, the files
written for cgroup v1 and v2 (in a stand-in directory), the rank's command, the refusal when
there is no CPU cgroup hierarchy, and the quota recorded in result files."""

from __future__ import annotations

import argparse
import os

import pytest

from moeflow.cluster.launcher import ClusterSpec
from moeflow.cluster.quota import (IN_FORCE_ENV, CpuQuota, RankCgroups, cleanup_stale, detect,
                                   in_force, parse_cpu_per_rank, usable_cores)
from moeflow.commands.common import quota_from_args, run_meta
from moeflow.config import ConfigError
from moeflow.launch import launch_local


def test_flag_values():
    assert parse_cpu_per_rank("none", 4) is None and parse_cpu_per_rank(None, 4) is None
    assert parse_cpu_per_rank("0.45", 4) == 0.45
    assert parse_cpu_per_rank("auto", 4) == pytest.approx(int(90 * usable_cores() / 4) / 100)
    assert parse_cpu_per_rank("auto", 1) <= 0.9 * usable_cores()
    with pytest.raises(ConfigError, match=r"--cpu-per-rank='half' is invalid.*0.45.*auto.*none"):
        parse_cpu_per_rank("half", 2)


def test_dataclass_checks():
    q = CpuQuota(0.45)
    assert q.enabled and q.quota_us == 4500 and q.period_us == 10_000 and q.threads == 1
    assert CpuQuota(1.0).threads == 1 and CpuQuota(1.2).threads == 2
    assert not CpuQuota().enabled
    with pytest.raises(ConfigError, match=r"period_us=20000 is invalid.*1000..10000"):
        CpuQuota(0.5, period_us=20_000)
    with pytest.raises(ConfigError, match=r"--cpu-per-rank 0.05 is invalid.*1000 us minimum"):
        CpuQuota(0.05)
    with pytest.raises(ConfigError, match=r"--cpu-per-rank -1 is invalid: give a positive"):
        CpuQuota(-1)
    with pytest.raises(ConfigError, match=r"--cpu-per-rank 999 is invalid.*at most"):
        CpuQuota(999.0)
    assert CpuQuota(0.5).oversubscribed(2 * usable_cores()) is None
    assert "more than" in CpuQuota(0.5).oversubscribed(2 * usable_cores() + 2)


def test_refused_without_a_cpu_hierarchy(tmp_path):
    q = CpuQuota(0.5, cgroup_root=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"--cpu-per-rank 0.5 needs a writable CPU cgroup "
                                          r".*absent has no CPU controller.*leave out "
                                          r"--cpu-per-rank"):
        RankCgroups(q, 2).create()
    # the local launcher refuses before any rank starts
    with pytest.raises(ConfigError, match="needs a writable CPU cgroup"):
        launch_local(os.getpid, 2, quota=q)
    assert detect(str(tmp_path)) is None and cleanup_stale(root=str(tmp_path)) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only directories")
def test_refused_when_not_writable(tmp_path):
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=r"--cpu-per-rank 0.5 needs a writable.*creating"):
            RankCgroups(CpuQuota(0.5, cgroup_root=str(tmp_path)), 2).create()
    finally:
        tmp_path.chmod(0o755)


def test_files_for_cgroup_v1(tmp_path):
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")         # stands in for the cpu mount
    groups = RankCgroups(CpuQuota(0.45, cgroup_root=str(tmp_path)), 3)
    groups.hierarchy, groups.version = detect(str(tmp_path))
    assert groups.version == 1
    groups.path = str(tmp_path / f"moeflow-{os.getpid()}-{groups.run_id}")
    os.mkdir(groups.path)
    groups._configure()
    assert (tmp_path / os.path.basename(groups.path) / "cpu.shares").read_text() == "262144"
    for r in range(3):
        d = tmp_path / os.path.basename(groups.path) / f"r{r}"
        assert d.joinpath("cpu.cfs_period_us").read_text() == "10000"
        assert d.joinpath("cpu.cfs_quota_us").read_text() == "4500"
    assert groups.rank_path(2) == f"{groups.path}/r2"
    assert groups.rank_path(2, via_proc=True) == f"/proc/{os.getpid()}/root{groups.path}/r2"


def test_files_for_cgroup_v2(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    groups = RankCgroups(CpuQuota(1.5, period_us=5000, cgroup_root=str(tmp_path)), 2)
    groups.hierarchy, groups.version = detect(str(tmp_path))
    assert groups.version == 2
    groups.path = str(tmp_path / f"moeflow-{os.getpid()}-{groups.run_id}")
    os.mkdir(groups.path)
    groups._configure()
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"
    group = tmp_path / os.path.basename(groups.path)
    assert group.joinpath("cgroup.subtree_control").read_text() == "+cpu"
    assert group.joinpath("cpu.weight").read_text() == "10000"
    assert group.joinpath("r1", "cpu.max").read_text() == "7500 5000"


def test_rank_command_joins_then_execs(tmp_path):
    groups = RankCgroups(CpuQuota(1.2), 2)
    groups.path = str(tmp_path / "moeflow-1-abcdef")
    cmd = groups.wrap(["python", "train.py", "--x", "$y"])
    assert cmd[:2] == ["/bin/sh", "-c"] and cmd[-4:] == ["python", "train.py", "--x", "$y"]
    assert cmd[3] == f"/proc/{os.getpid()}/root{groups.path}"
    script = cmd[2]
    assert "$$" not in script            # torchrun's argument templating would eat it
    assert 'exec "$@"' in script and "OMP_NUM_THREADS=2" in script
    assert f"{IN_FORCE_ENV}=1.2" in script and '"$0/r$RANK/cgroup.procs"' in script


def test_cluster_spec_takes_a_quota():
    assert not ClusterSpec(2, 2).quota.enabled
    assert ClusterSpec(2, 2, quota=CpuQuota(0.45)).quota.quota_us == 4500
    with pytest.raises(Exception, match="quota=0.45 is invalid"):
        ClusterSpec(2, 2, quota=0.45)


def test_result_files_record_the_quota(monkeypatch):
    monkeypatch.delenv(IN_FORCE_ENV, raising=False)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert run_meta()["cpu_per_rank"] is None
    assert run_meta(argparse.Namespace(cpu_per_rank="none", nproc=4))["cpu_per_rank"] is None
    assert run_meta(argparse.Namespace(cpu_per_rank="0.45", nproc=4))["cpu_per_rank"] == 0.45
    auto = run_meta(argparse.Namespace(cpu_per_rank="auto", nproc=4))["cpu_per_rank"]
    assert auto == parse_cpu_per_rank("auto", 4)
    monkeypatch.setenv(IN_FORCE_ENV, "0.3")         # a rank of `moeflow cluster run`
    assert in_force() == 0.3 and run_meta()["cpu_per_rank"] == 0.3


def test_local_quota_refused_under_torchrun(monkeypatch):
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "x"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="under torchrun.*moeflow cluster run --cpu-per-rank"):
        quota_from_args(argparse.Namespace(cpu_per_rank="0.5", nproc=2))
    assert not quota_from_args(argparse.Namespace(cpu_per_rank="none", nproc=2)).enabled


def test_cluster_run_flag_refused_clearly():
    from moeflow.commands.cluster_command import run_run

    args = argparse.Namespace(command=["--", "true"], nodes=2, ranks_per_node=2,
                              inter_bw="1gbit", inter_latency=None, intra_bw=None,
                              intra_latency=None, mtu=1500, max_restarts=0, cpu_per_rank="lots")
    with pytest.raises(SystemExit, match=r"cluster run: error: --cpu-per-rank='lots' is invalid"):
        run_run(args)
    args.cpu_per_rank = "0.01"
    with pytest.raises(SystemExit, match=r"--cpu-per-rank 0.01 is invalid.*minimum"):
        run_run(args)
