"""Counting the operations that would make the host wait for a CUDA device, on CPU.

A ``TorchDispatchMode`` sees every aten op of the thread that entered it; the ops below either
return a host value or have an output size that depends on the data (so CUDA must finish and
copy back first). Host conversions that bypass the dispatcher on CPU (``tolist``, ``numpy``,
``cpu``) are counted by wrapping those ``Tensor`` methods. The layer's communication lane runs
on its own thread, so the counter is entered there too (``CommLane.run`` is wrapped).
Importable by spawned ranks.
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


# Codecs whose CPU coder is numpy code (zfp's numba coder, LLNL's zfpy): on CPU they read the
# payload through numpy by design, which on CPU is no device wait; their CUDA path (zfp's Triton
# kernels) is checked by the gpu suite. Every other codec is pure torch and held to the budget.
HOST_CODECS = ("zfp", "zfpy")


def layer_cases(topo) -> list[dict]:
    """Every all-to-all algorithm the topology takes x every codec x schedule/r x capacity."""
    from moeflow.comm.alltoall import ALLTOALLS
    from moeflow.comm.codecs import CODECS
    from moeflow.config import ConfigError

    algos = []
    for name in ("direct", "pairwise", "hier1d", "hier2d", "pipe", "bilevel"):
        try:
            ALLTOALLS[name].check_topology(topo)
        except ConfigError:
            continue
        algos.append(name)
    cases = []
    for a2a in algos:
        for codec in CODECS:
            for schedule, r in (("sequential", 1), ("pipelined", 2), ("optsche", 2)):
                for cf in (1.25, None):
                    cases.append(dict(a2a=a2a, codec=codec, schedule=schedule,
                                      pipeline_degree=r, capacity_factor=cf))
    return cases


def hot_path_worker(local_size: int | None) -> dict:
    """Per case: the would-be syncs of the second forward + backward (the first warms up;
    None for ``HOST_CODECS``), and under bf16 autocast the dtypes of the output and of the
    input's gradient next to those of a dense FFN (``nn.Linear``) on the same input."""
    from moeflow import MoEConfig, MoELayer, Topology

    topo = Topology.from_env(local_size=local_size)
    gen = torch.Generator().manual_seed(topo.rank)
    x = torch.randn(12, 16, generator=gen, requires_grad=True)
    dense = torch.nn.Linear(16, 16)
    out = {}
    for case in layer_cases(topo):
        cfg = MoEConfig(d_model=16, d_expert=32, num_experts=4, top_k=2, seed=1, **case)
        layer = MoELayer(cfg, topo)
        syncs = None
        if case["codec"] not in HOST_CODECS:
            step_syncs(layer, x)
            syncs = dict(step_syncs(layer, x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, want = layer(x), dense(x)
        (gx,) = torch.autograd.grad(y.float().square().sum(), x)
        out[tuple(sorted(case.items()))] = {"syncs": syncs, "dtype": y.dtype,
                                            "dense_dtype": want.dtype, "grad_dtype": gx.dtype}
    return out
