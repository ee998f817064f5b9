"""FasterMoE-style shadowing as an FSSDP placement (the baseline of ``moeflow bench hecate``).

FasterMoE (He et al., PPoPP'22: "shadowing") keeps expert parallelism's storage and, per
iteration, after the gate has counted the tokens, broadcasts the parameters of the most popular
experts to every rank ("shadows" them), so each rank computes its own tokens for them; their
gradients are reduced back. HECATE (``hecate.txt``, related work and the baselines of its
evaluation: "FasterMoE [16] selectively replicates experts to every device after obtaining MoE
gating decisions") -- in FSSDP terms ``P'`` with the shadowed experts held by every rank and
the owners (``P``) static: :func:`shadow_placement`. moeflow's token plan then
computes a shadowed expert's tokens where they are (local first, Section 4.4), and spRS reduces
the copies' gradients to the owner, which is FasterMoE's gradient reduction.

What differs from HECATE's Algorithm 1 here is the *choice*: FasterMoE decides on the current
iteration's global counts (exchanged after the gate, on the critical path), Algorithm 1 on the
sliding-window estimate before the iteration. :func:`current_loads` is that count exchange.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.placement import Placement


def shadow_placement(owners: Placement, loads, num_shadowed: int) -> Placement:
    """``P'``: the ``num_shadowed`` most loaded experts (ties: lower id) held by every rank,
    every other expert by its owner only; owners unchanged."""
    loads = np.asarray(loads, dtype=np.float64)
    E = owners.num_experts
    if loads.shape != (E,):
        raise ConfigError(f"shadow_placement loads has shape {loads.shape}; give one load per "
                          f"expert ({E},)")
    if isinstance(num_shadowed, bool) or not isinstance(num_shadowed, int) \
            or not 0 <= num_shadowed <= E:
        raise ConfigError(f"shadow_placement num_shadowed={num_shadowed!r} is invalid: give an "
                          f"int in [0, {E}] (experts replicated on every rank)")
    top = set(sorted(range(E), key=lambda e: (-loads[e], e))[:num_shadowed])
    everyone = frozenset(range(owners.world_size))
    return owners.materialize([everyone if e in top else {owners.owners[e]}
                               for e in range(E)])


@torch.no_grad()
def current_loads(router, x: torch.Tensor, num_experts: int, group=None) -> np.ndarray:
    """FasterMoE's count exchange: the gate's choices on this rank's ``x``, summed over the
    ranks (an all-reduce of ``num_experts`` integers, bounded by the group's timeout)."""
    chosen = router(x).experts.reshape(-1)
    counts = torch.bincount(chosen, minlength=num_experts).to(torch.int64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return counts.numpy()


__all__ = ["current_loads", "shadow_placement"]
