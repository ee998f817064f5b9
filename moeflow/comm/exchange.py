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

from moeflow.topology import Topology

# torch >= 2.10 names it all_gather_single (all_gather_into_tensor warns there)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def to_host(t: torch.Tensor) -> np.ndarray:
    """The one place device integers come to the host (a synchronisation on CUDA)."""
    return np.asarray(t.tolist(), dtype=np.int64)


def gather_device_counts(counts: torch.Tensor, topo: Topology) -> np.ndarray:
    """``counts: (E,)`` on the device -> ``N: (ep, E)`` on the host, row p from EP rank p."""
    if topo.ep_size == 1:
        return to_host(counts).reshape(1, -1)
    out = counts.new_empty(topo.ep_size * counts.numel())
    _all_gather(out, counts.contiguous(), group=topo.ep_group)
    return to_host(out).reshape(topo.ep_size, -1)


def _has_cpu_backend(group) -> bool:
    try:
        group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return False
    return True


def gather_host_ints(values: list[int], topo: Topology,
                     device: torch.device) -> np.ndarray:
    """Host integers of every EP rank, ``(ep, len(values))``, without touching the device when
    the group has a CPU backend (else through ``device``: one synchronisation)."""
    mine = np.asarray(values, dtype=np.int64)
    if topo.ep_size == 1:
        return mine.reshape(1, -1)
    if not _has_cpu_backend(topo.ep_group):
        t = torch.as_tensor(mine, device=device)
        out = t.new_empty(topo.ep_size * t.numel())
        _all_gather(out, t, group=topo.ep_group)
        return to_host(out).reshape(topo.ep_size, -1)
    got = np.empty(topo.ep_size * mine.size, dtype=np.int64)     # host memory throughout
    _all_gather(torch.from_numpy(got), torch.from_numpy(mine),
                                group=topo.ep_group)
    return got.reshape(topo.ep_size, -1)
