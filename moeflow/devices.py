"""Devices, dtypes, process-group backends, host-side collectives and a device-aware stopwatch.

One place for what every command needs to run on CPU or on CUDA:

* ``--device auto|cpu|cuda``: :func:`check_device` validates the name (and that CUDA exists
  when it is asked for) before any rank starts; :func:`resolve_device` gives the rank's device,
  ``cuda:LOCAL_RANK`` on CUDA (torchrun's numbering) and makes it the current device.
* ``--dtype auto|bf16|fp32``: :func:`resolve_dtype` gives the autocast dtype (``auto``: bf16 on
  CUDA, fp32 on CPU; bf16 autocast on CPU is allowed); :func:`autocast` is the context.
* :func:`pg_backend` builds the process-group backend string: ``cpu:gloo,cuda:nccl`` on CUDA,
  so the same group carries NCCL collectives of device tensors and gloo collectives of CPU
  tensors (timings, counters, the chooser's predictions), ``gloo`` on CPU.
* :func:`host_all_reduce` reduces a few Python floats over a group in one collective, on a
  device that group can carry (CPU when it has gloo, the current CUDA device on an NCCL-only
  group that a user created), so host-side bookkeeping never depends on how the group was made.
* :func:`cache_block_rows`: rows per block for memory-bound loops on CPU (the combine, the
  experts' input gradient under autocast), so that a block's temporaries stay in cache.
* :class:`Stopwatch` times work on a device: CUDA events on CUDA (the host clock around
  asynchronous kernels would measure the launch, not the work), ``time.perf_counter`` on CPU.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from moeflow.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")     # auto: cuda when a GPU is visible, else cpu
DTYPES = ("auto", "bf16", "fp32")     # autocast dtype; auto: bf16 on cuda, fp32 on cpu

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (a function, so tests can replace it)."""
    return torch.cuda.is_available()


def check_device(name: str, flag: str = "--device") -> str:
    """Validate a device name; return its type (``cpu`` or ``cuda``, ``auto`` resolved).

    Raises :class:`ConfigError` naming ``flag`` for an unknown name, or for ``cuda`` on a
    machine without CUDA.
    """
    if name not in DEVICES:
        raise ConfigError(f"{flag} {name!r} is invalid: choose one of {', '.join(DEVICES)} "
                          "(auto: cuda when a GPU is visible, else cpu)")
    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if name == "cuda" and not cuda_available():
        raise ConfigError(f"{flag} cuda is invalid here: torch sees no CUDA device "
                          f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
                          f"use {flag} cpu, or run on a machine with a GPU and a CUDA build "
                          "of torch")
    return name


def check_dtype(name: str, flag: str = "--dtype") -> None:
    if name not in DTYPES:
        raise ConfigError(f"{flag} {name!r} is invalid: choose one of {', '.join(DTYPES)} "
                          "(auto: bf16 autocast on CUDA, fp32 on CPU)")


def local_rank() -> int:
    """This process's index on its node (torchrun's ``LOCAL_RANK``; 0 for a lone process)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def check_local_ranks(device_type: str, ranks_per_node: int, flag: str = "--nproc") -> None:
    """On CUDA every rank of a node needs its own GPU (NCCL cannot share one between ranks)."""
    if device_type != "cuda":
        return
    count = torch.cuda.device_count()
    if ranks_per_node > count:
        raise ConfigError(f"{flag} {ranks_per_node} is invalid with --device cuda: this machine "
                          f"has {count} CUDA device(s) and each rank needs its own; use "
                          f"{flag} {count} (or --device cpu)")


def resolve_device(name: str, flag: str = "--device") -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` (made current) or ``cpu``."""
    if check_device(name, flag) == "cpu":
        return torch.device("cpu")
    index = local_rank()
    check_local_ranks("cuda", index + 1, "LOCAL_RANK")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def resolve_dtype(name: str, device: torch.device, flag: str = "--dtype") -> torch.dtype:
    """The autocast dtype: ``auto`` is bf16 on CUDA and fp32 on CPU."""
    check_dtype(name, flag)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on ``device`` for a bf16 ``dtype``; no context for fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def pg_backend(device_type: str) -> str:
    """The process-group backend for ranks computing on ``device_type``.

    CUDA: ``cpu:gloo,cuda:nccl`` (device tensors over NCCL, host tensors over gloo); CPU:
    ``gloo``.
    """
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(f"pg_backend({device_type!r}): the device type must be cpu or cuda")
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def group_backend(group=None) -> str | None:
    """The backend configuration of ``group`` (``None`` when torch.distributed is not
    initialised): what :func:`torch.distributed.new_group` must get so that a subgroup carries
    the same device types as the world."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_backend_config(group)


def host_tensor_device(group=None) -> torch.device:
    """Where a host-side tensor must live to travel on ``group``: CPU when the group has a CPU
    backend, else (an NCCL-only group) the current CUDA device."""
    config = group_backend(group)            # e.g. "cpu:gloo,cuda:nccl" or "cuda:nccl"
    if config is None or "cpu:" in config:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def host_all_reduce(values: list[float], op: str = "sum", group=None) -> list[float]:
    """Reduce a few floats over ``group`` in one collective (float64); ``op``: sum, max or
    mean. Returns ``values`` unchanged without a distributed group."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "mean": dist.ReduceOp.SUM}
    if op not in ops:
        raise ValueError(f"host_all_reduce op={op!r}: choose sum, max or mean")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=host_tensor_device(group))
    dist.all_reduce(t, op=ops[op], group=group)
    if op == "mean":
        t /= dist.get_world_size(group)
    return t.tolist()


class Stopwatch:
    """Times the work issued between :meth:`start` and :meth:`stop` on ``device``.

    CUDA: two ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream; ``stop``
    waits for the end event and returns the device time between them. Elsewhere: the host's
    ``time.perf_counter``. Either way ``stop`` returns seconds.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._t0 = 0.0
        self._start = self._end = None

    def start(self) -> "Stopwatch":
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0


def to_device_async(values, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """Host integers (a list or numpy array) -> a tensor on ``device`` without making the host
    wait: on CUDA the copy is from pinned memory and non-blocking (a copy from pageable memory
    synchronises the stream first); elsewhere a plain tensor."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


#: Why the MoE layer refuses CUDA-graph capture (docs/gpu.md, "CUDA graphs").
CUDA_GRAPH_ERROR = (
    "{where} was called while a CUDA graph is being captured "
    "(torch.cuda.is_current_stream_capturing()): the MoE layer cannot be captured, because its "
    "all-to-all split sizes depend on the routing and are read on the host, its collectives "
    "run on a communication thread and stream, and some bookkeeping travels over gloo. Capture "
    "only the dense parts (torch.cuda.make_graphed_callables on the attention/FFN blocks), or "
    "compile without CUDA graphs (torch.compile mode='default' or "
    "'max-autotune-no-cudagraphs', not 'reduce-overhead')")


def cache_block_rows(rows: int, width: int, device: torch.device) -> int:
    """Rows per block of a memory-bound loop over ``(rows, width)`` buffers on CPU: about
    1 MiB of float32 temporaries per block, which stay in the core's cache between a block's
    gather, conversion, product and sum, instead of each op streaming the whole buffer
    through memory. All rows in one block on other devices (one kernel per op there)."""
    if device.type != "cpu":
        return max(rows, 1)
    return max(1, (1 << 18) // max(width, 1))


def check_not_capturing(where: str) -> None:
    """Raise a RuntimeError naming ``where``, why and the fix when the current CUDA stream is
    capturing a graph (call it only for CUDA inputs: the query needs a CUDA build)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(CUDA_GRAPH_ERROR.format(where=where))


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
