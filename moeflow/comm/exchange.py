"""Exchanging row counts before the all-to-all ("counts travel first"), once per layer call.

Every rank learns the whole count matrix ``N[p][e]`` (rows rank p sends to global expert e), so
every all-to-all of the call, every pipelined chunk and every hierarchical algorithm can derive
its split sizes on the host without further messages (ScheMoE section 5 needs the whole split
matrix for its multi-step algorithms; docs/design.md, "The path of a token", step 4).

* Dropless: the counts live on the device. One ``all_gather_into_tensor`` of ``E`` integers,
  then one device-to-host copy: the layer's single host synchronisation.
* Capacity: every rank sends ``C_p`` rows to every expert, where ``C_p`` follows from its local
  token count, which the host knows. The integers travel as CPU tensors over the group's CPU
  backend (gloo; a ``cpu:gloo,cuda:nccl`` group on GPUs), so the device is never waited for.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeflow.devices import host_tensor_device

# torch >= 2.10 names it all_gather_single (all_gather_into_tensor warns there)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def to_host(t: torch.Tensor) -> np.ndarray:
    """The one place device integers come to the host (a synchronisation on CUDA)."""
    return np.asarray(t.tolist(), dtype=np.int64)


def gather_device_counts(counts: torch.Tensor, group, size: int) -> np.ndarray:
    """``counts: (E,)`` on the device -> ``(size, E)`` on the host, row p from rank p of
    ``group`` (the EP group; Parm's EP&ESP group)."""
    if size == 1:
        return to_host(counts).reshape(1, -1)
    out = counts.new_empty(size * counts.numel())
    _all_gather(out, counts.contiguous(), group=group)
    return to_host(out).reshape(size, -1)


def gather_host_ints(values: list[int], group, size: int) -> np.ndarray:
    """Host integers of every rank of ``group``, ``(size, len(values))``, in host memory
    throughout when the group has a CPU backend (else through the current GPU: one
    synchronisation; :func:`moeflow.devices.host_tensor_device` decides)."""
    mine = np.asarray(values, dtype=np.int64)
    if size == 1:
        return mine.reshape(1, -1)
    where = host_tensor_device(group)
    if where.type != "cpu":
        t = torch.as_tensor(mine, device=where)
        out = t.new_empty(size * t.numel())
        _all_gather(out, t, group=group)
        return to_host(out).reshape(size, -1)
    got = np.empty(size * mine.size, dtype=np.int64)
    _all_gather(torch.from_numpy(got), torch.from_numpy(mine), group=group)
    return got.reshape(size, -1)
