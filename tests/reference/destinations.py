"""The destination rank of each token choice under HECATE's topology-aware dispatch (Section
4.4), one token at a time on the host: the reference that :mod:`moeflow.strategies.fssdp.token_plan`
(vectorised on the device) is held to."""

from __future__ import annotations

import numpy as np
import torch

from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.topology_dispatch import dispatch_plan
from moeflow.strategies.fssdp.placement import Placement


def token_destinations(experts: torch.Tensor, placement: Placement, rank: int,
                       local_size: int) -> torch.Tensor:
    """The destination rank of each of this rank's choices ``experts`` (any shape, int ids).

    Tokens of one expert, in their order in ``experts.flatten()``, fill the candidates of
    :func:`dispatch_plan`'s row for ``rank`` in ascending rank order (contiguous blocks).
    """
    if experts.dtype.is_floating_point or experts.dtype == torch.bool:
        raise ConfigError(f"token_destinations experts of dtype {experts.dtype} are invalid: "
                          "give integer expert ids")
    flat = experts.reshape(-1).to(torch.int64).cpu()
    if flat.numel() and (flat.min() < 0 or flat.max() >= placement.num_experts):
        raise ConfigError(f"token_destinations expert ids span [{int(flat.min())}, "
                          f"{int(flat.max())}]: they must lie in [0, {placement.num_experts})")
    counts = np.zeros((placement.world_size, placement.num_experts), dtype=np.int64)
    counts[rank] = np.bincount(flat.numpy(), minlength=placement.num_experts)
    row = dispatch_plan(placement, counts, local_size)[rank]       # (E, world)
    out = torch.empty_like(flat)
    for e in range(placement.num_experts):
        idx = (flat == e).nonzero().view(-1)
        dests = np.repeat(np.arange(placement.world_size), row[e])
        out[idx] = torch.from_numpy(dests)
    return out.view(experts.shape).to(experts.device)
