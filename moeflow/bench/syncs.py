"""Counting the operations that would make the host wait for a CUDA device, on any device.

A ``TorchDispatchMode`` sees every aten op of the thread that entered it; the ops below either
return a host value or have an output size that depends on the data (so CUDA must finish and
copy back first). Host conversions that bypass the dispatcher on CPU (``tolist``, ``numpy``,
``cpu``) are counted by wrapping those ``Tensor`` methods. The MoE layer's communication lane
runs on its own thread, so the counter is entered there too (``CommLane.run`` is wrapped).
Used by ``moeflow bench layer`` (host syncs per step) and by the tests of the sync budget.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.bincount.default, aten.equal.default, aten.is_nonzero.default,
            aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default}
WRAPPED = ("tolist", "numpy", "cpu")


class SyncCounter(TorchDispatchMode):
    """Counts would-be device-to-host synchronisations by kind (thread-safe)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS:
            self.add(str(func))
        elif func is aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.add("boolean-mask index")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.add("repeat_interleave without output_size")
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting():
    """Count would-be syncs on this thread, the comm lane and in wrapped Tensor methods."""
    from moeflow.schedule.streams import CommLane

    counter = SyncCounter()
    saved = {name: getattr(torch.Tensor, name) for name in WRAPPED}
    saved_run = CommLane.run

    def wrap(name):
        def method(self, *a, **k):
            counter.add(f"Tensor.{name}")
            return saved[name](self, *a, **k)
        return method

    def run(lane, fn, device):
        with counter:
            return saved_run(lane, fn, device)

    for name in WRAPPED:
        setattr(torch.Tensor, name, wrap(name))
    CommLane.run = run
    try:
        with counter:
            yield counter
    finally:
        for name, m in saved.items():
            setattr(torch.Tensor, name, m)
        CommLane.run = saved_run


def step_syncs(layer, x: torch.Tensor) -> Counter:
    """Would-be syncs of one forward + backward of ``layer`` (the loss kept on the device)."""
    with counting() as c:
        y = layer(x)
        (y.square().mean() + layer.aux_loss).backward()
    return c.counts
