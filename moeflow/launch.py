"""Start ranks: on this machine through torch's elastic launcher (torchrun's machinery), or join
the job torchrun started.

``launch_local(fn, nproc, *args)`` runs ``fn(*args)`` in ``nproc`` fresh processes with
torch.distributed initialised (gloo on CPU; ``cpu:gloo,cuda:nccl`` on GPUs, so that CPU tensors
still travel, over gloo, next to NCCL's device tensors) and returns ``{rank: result}``.
``init_from_env`` is what each rank (ours or torchrun's) calls.
Every collective is bounded by ``timeout_s``: a rank that dies makes the others fail with an
error instead of hanging.

``quota``: a :class:`~moeflow.cluster.quota.CpuQuota`; with cores per rank set, every rank
runs in a CPU cgroup of its own held to that share, with ceil(cores) torch threads (the GPU-like
mode, docs/benchmarks/cluster.md); the groups are removed when the launch ends, however it ends.

``max_restarts``: how often torch's elastic agent restarts all ranks after one fails (its own
``max_restarts``; a restarted rank sees ``TORCHELASTIC_RESTART_COUNT`` > 0, see
:func:`restart_count`, and ``moeflow train`` resumes from its latest checkpoint then).
"""

from __future__ import annotations

import datetime
import os
import sys
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from moeflow.cluster.quota import IN_FORCE_ENV, CpuQuota, RankCgroups, join
from moeflow.devices import pg_backend


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher setting its env)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def local_quota(cpu_per_rank: str | float | None, nproc: int) -> CpuQuota:
    """The validated :class:`CpuQuota` of a ``--cpu-per-rank`` value for ``nproc`` ranks
    started here (a number, ``auto`` or ``none``); refused under torchrun, whose launcher
    started the ranks (``moeflow cluster run --cpu-per-rank`` sets it there)."""
    from moeflow.cluster.quota import parse_cpu_per_rank
    from moeflow.errors import ConfigError

    cores = parse_cpu_per_rank(cpu_per_rank, nproc)
    if cores is not None and under_torchrun():
        raise ConfigError(f"--cpu-per-rank {cpu_per_rank} is invalid under torchrun, which "
                          "started the ranks already: give it to `moeflow cluster run "
                          "--cpu-per-rank` instead, or leave it out")
    return CpuQuota(cores)


NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def restart_count() -> int:
    """How often torch's elastic agent has restarted this job's ranks (0: the first attempt,
    or not under the agent)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def init_from_env(timeout_s: float = 300.0, backend: str | None = None) -> None:
    """Initialise torch.distributed from the launcher's environment (no-op if already done).

    backend: ``None`` picks ``cpu:gloo,cuda:nccl`` when CUDA is available, else gloo
    (:func:`moeflow.devices.pg_backend`). With NCCL in the backend the rank's current device
    is ``cuda:LOCAL_RANK`` and the process group is bound to it (``device_id``: eager NCCL
    communicators).
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = pg_backend("cuda" if torch.cuda.is_available() else "cpu")
    kw = {}
    if "nccl" in backend:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        # bound device: NCCL forms the world's communicator now and every subgroup's when
        # Topology creates it (ncclCommSplit, every rank in one order), not lazily at the
        # first operation of each, which a rank with nothing to send may skip (docs/gpu.md)
        kw["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)


def _entry(fn: Callable, args: tuple, timeout_s: float, backend: str | None,
           threads: int, quota_group: str | None = None,
           cpu_per_rank: float | None = None) -> Any:
    if quota_group is not None:          # first: everything this rank computes is held to it
        join(os.path.join(quota_group, f"r{os.environ['RANK']}"))
        os.environ[IN_FORCE_ENV] = repr(cpu_per_rank)
    torch.set_num_threads(threads)
    init_from_env(timeout_s, backend)
    # On an exception the process group is left to the process's exit: the launcher's
    # ``record`` writes this rank's error file first, so the rank that failed first is the one
    # whose error file is oldest (its peers fail when its connections close).
    try:
        result = fn(*args)
    except (Exception, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:     # e.g. DCP's CheckpointException, which ``record`` misses
        raise RuntimeError(f"{type(err).__name__}: {err}") from err
    dist.destroy_process_group()
    return result


def launch_local(fn: Callable, nproc: int, *args, timeout_s: float = 300.0,
                 backend: str | None = "gloo", threads: int | None = None,
                 log_dir: str | None = None, max_restarts: int = 0,
                 quota: CpuQuota | None = None) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks; return ``{rank: fn's return value}``.

    ``fn`` must be importable (a module-level function). A failing rank raises
    ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` here with its
    traceback (the launcher records each rank's exception in an error file: under
    ``log_dir/<launch id>/attempt_0/<rank>/error.json`` when ``log_dir`` is given, else in a
    temporary folder). With ``max_restarts`` > 0 the agent restarts every rank (fresh
    processes) after a failure, up to that many times; the error is raised when the last
    attempt fails.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"nproc={nproc} is invalid: need at least one rank")
    if max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts} is invalid: need >= 0")
    quota = quota or CpuQuota()
    if quota.enabled:
        threads = quota.threads                  # the thread count follows the quota
    elif threads is None:
        threads = max(1, (os.cpu_count() or 1) // nproc)
    if max_restarts:
        # The agent's rendezvous store, shared with the ranks by default, outlives a restart,
        # and the restarted ranks' process group then reads the dead ranks' addresses from it
        # (a known torch elastic behaviour in torch 2.x): opt out, so rank 0 of each attempt
        # hosts a fresh store.
        os.environ.setdefault(NO_SHARED_STORE, "1")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                          run_id=f"moeflow-{uuid.uuid4().hex[:8]}", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method="spawn",
                          # the agent passes these on to the ranks (SIGUSR1: moeflow train's
                          # preemption signal; torch's default list lacks it)
                          signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                          logs_specs=DefaultLogsSpecs(log_dir=log_dir))
    if not quota.enabled:
        return elastic_launch(config, _entry)(fn, args, timeout_s, backend, threads)
    warning = quota.oversubscribed(nproc)
    if warning:
        print(f"moeflow: {warning}", file=sys.stderr)
    # the agent turns SIGTERM/SIGINT/SIGHUP into an exception here, so the groups go on any
    # end but kill -9 (then the next quota'd launch or `moeflow cluster cleanup` removes them)
    with RankCgroups(quota, nproc) as groups:
        return elastic_launch(config, _entry)(fn, args, timeout_s, backend, threads,
                                              groups.path, quota.cpu_per_rank)
