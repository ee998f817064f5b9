"""Where scheduled tasks run and how their data crosses between the two lanes.

ScheMoE section 3.2 runs computing tasks (compress, decompress, experts) and communication tasks
(all-to-all) on two lanes. Here:

* The computing lane is the caller's thread and, on CUDA, its current stream.
* The communication lane is one worker thread (collectives are issued in the same order on every
  rank, so they stay matched) and, on CUDA, one communication stream per device shared by every
  layer's lane (:func:`comm_stream`): a high-priority stream, so the all-to-alls' kernels are
  scheduled ahead of the experts' GEMMs that they overlap with, and one per device rather than
  one per layer, because torch hands streams out round-robin from a pool of 32 per priority and
  a 33rd layer would silently share (and serialise with) another's. The task runs under
  ``torch.cuda.device(...)`` (entered and left, so the calling thread's current device is what
  it was) and with the stream current, so collectives
  (NCCL enqueues on its own stream after waiting for the current one) and the algorithms'
  layout copies run there, and every ``work.wait()`` inside an algorithm is a stream
  dependency, not a host block.

A hand-off from the computing lane to the communication lane records an event on the compute
stream that the communication stream waits for, and marks the payload tensors as used on the
communication stream (``record_stream``), so the caching allocator cannot reuse them early.
The way back records an event on the communication stream that the compute stream waits for,
and marks the received tensors as used on the compute stream. The host never waits for the
device. On CPU (gloo) all of this is a no-op: gloo's work handles block the lane thread, the
future carries the result.

Timing stamps follow the same rule: ``perf_counter`` on CPU, CUDA events recorded on the lane's
stream on GPUs, resolved to seconds only when a timeline is read.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


#: The communication streams, one per CUDA device index, shared by every lane of the process.
_COMM_STREAMS: dict[int, "torch.cuda.Stream"] = {}
#: Stream priority of the communication lane (lower is higher; -1 is CUDA's high priority).
COMM_PRIORITY = -1


def comm_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """The process's high-priority communication stream of a CUDA ``device`` (created on first
    use, then cached); ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    stream = _COMM_STREAMS.get(idx)
    if stream is None:
        stream = _COMM_STREAMS[idx] = torch.cuda.Stream(device=idx, priority=COMM_PRIORITY)
    return stream


class CommLane:
    """One communication lane: a single background thread (created on first use) and, per CUDA
    device, the shared communication stream (:func:`comm_stream`)."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None

    def stream(self, device: torch.device) -> "torch.cuda.Stream | None":
        return comm_stream(device)

    def run(self, fn: Callable[[], Any], device: torch.device) -> Any:
        """Run ``fn`` as a communication task of ``device`` on the calling thread. Autocast is
        off: communication moves bytes and keeps their dtype (an inline task would otherwise
        inherit the caller's autocast state)."""
        stream = self.stream(device)
        with torch.autocast(device.type, enabled=False):
            if stream is None:
                return fn()
            # entered and left: an inline task on a compute or autograd thread must not change
            # that thread's current device
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                return fn()

    def submit(self, fn: Callable[[], Any], device: torch.device) -> Future:
        """Queue ``fn`` on the lane thread (FIFO: the issue order is the execution order)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeflow-comm")
        return self._pool.submit(self.run, fn, device)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # A lane is a resource, not state: copies and pickles of a layer get a fresh one.
    def __deepcopy__(self, memo) -> "CommLane":
        return CommLane()

    def __getstate__(self) -> dict:
        return {"_pool": None}


class Handoff:
    """Stream discipline for data crossing between the lanes of one device (no-op on CPU)."""

    def __init__(self, lane: CommLane, device: torch.device):
        self.comm = lane.stream(device)
        self.compute = torch.cuda.current_stream(device) if self.comm is not None else None

    def ready(self) -> "torch.cuda.Event | None":
        """On the compute lane, after the producer: the point the comm lane must wait for."""
        if self.comm is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.compute)
        return ev

    def enter(self, ready: "torch.cuda.Event | None", payload: Any) -> None:
        """On the comm lane, before using ``payload`` made on the compute lane."""
        if self.comm is None:
            return
        self.comm.wait_event(ready)
        for t in _tensors(payload):
            t.record_stream(self.comm)

    def leave(self) -> "torch.cuda.Event | None":
        """On the comm lane, after the task: the point the compute lane must wait for."""
        if self.comm is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.comm)
        return ev

    def consume(self, done: "torch.cuda.Event | None", result: Any) -> None:
        """On the compute lane, before using ``result`` made on the comm lane."""
        if self.comm is None:
            return
        self.compute.wait_event(done)
        for t in _tensors(result):
            t.record_stream(self.compute)


class Clock:
    """Timestamps of the current lane: host seconds on CPU, CUDA events on GPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def stamp(self) -> "float | torch.cuda.Event":
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
