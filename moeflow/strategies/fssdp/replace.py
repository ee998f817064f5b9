"""SmartMoE-style periodic expert re-placement: HECATE's "expert rearrangement" peer.

HECATE (``hecate.txt``) compares FSSDP against *rearrangement* systems. Section 2.3 ("Expert
Rearrangement") describes SmartMoE (Zhai et al., USENIX ATC'23, its reference [44]): it
"periodically exchanges the positions of experts between devices, aiming to balance device
loads with combinations of expert loads, e.g., placing the experts with the most and least
tokens on the same device and vice versa", moving each expert "along with [its] optimizer
states"; Section 5.1 ("Baselines"): SmartMoE "exchanges experts between devices to balance
device load, with its strategy relying on the presence of multiple experts on each device", and
its rearrangement frequency is a hyper-parameter (Section 2.3, C2). FlexMoE (Nie et al.,
SIGMOD'23, [31]) adds replicas to the relocation; replication is FasterMoE-style shadowing /
HECATE's Algorithm 1 here, so this module implements the relocation only.

No SmartMoE or FlexMoE paper is in this repository: the algorithm below is written from
HECATE's description above, not from SmartMoE's own text. As implemented:

* every ``replace_every`` optimizer steps (``FSSDPOptions.replace_every``), for each FSSDP layer
  separately, from the layer's load window (the mean per-expert load of the last ``window``
  training forwards, every rank's counts from the count exchange, so every rank has the same
  numbers), :func:`balanced_owners` re-assigns whole experts to ranks: **no replication**, each
  rank keeps exactly as many of the layer's experts as it owns now (a permutation of positions:
  memory per rank is unchanged, the "exchange" of Section 2.3). The search is the greedy
  longest-processing-time rule under that count constraint: experts by descending load, each
  to the least-loaded rank that still has a free position, which pairs the most loaded experts
  with the least loaded ones as HECATE describes (ties: the current owner first, so that equal
  loads do not move experts, then the lower rank);
* the new assignment is taken only if its predicted most-loaded rank carries strictly less
  load than the current assignment's (otherwise nothing moves: a re-placement that cannot help
  costs no migration);
* the experts' parameters **and optimizer state** then move to their new owners
  (:func:`moeflow.strategies.fssdp.reshard.apply_owners`: batched point-to-point of the slot rows of
  the parameter and of every optimizer-state tensor of its shape), on the critical path;
* between re-placements the data flow is plain expert parallelism with the current owners
  (``materialize="static"``: ``P' = P``, no spAG, no spRS).

The one difference from a SmartMoE deployment is the storage: the experts live in FSSDP's slot
tensor, so that ``apply_owners`` can move rows under a standard ``torch.optim`` optimizer; the
step's communication is EP's all-to-all only.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.reshard import apply_owners, due, fssdp_layers


def rank_loads(loads, owners, world: int) -> np.ndarray:
    """Tokens per rank when expert ``e`` (load ``loads[e]``) lives on ``owners[e]``."""
    return np.bincount(np.asarray(owners, dtype=np.int64),
                       weights=np.asarray(loads, dtype=np.float64), minlength=world)


def balanced_owners(loads, owners, world: int) -> list[int]:
    """The greedy re-placement search: ``loads[e]`` (expert ``e``'s estimated load) and the
    current ``owners[e]`` -> new owners, each rank keeping its current number of experts.
    Experts by descending load (ties: lower id) go to the least-loaded rank with a free
    position (ties: the current owner, then the lower rank). Deterministic: a function of its
    inputs only, so every rank computes the same assignment."""
    loads = np.asarray(loads, dtype=np.float64)
    owners = [int(r) for r in owners]
    if loads.shape != (len(owners),):
        raise ConfigError(f"balanced_owners: loads of shape {loads.shape} for {len(owners)} "
                          "experts; give one load per expert")
    if any(not 0 <= r < world for r in owners):
        raise ConfigError(f"balanced_owners: owners {owners} name a rank outside 0..{world - 1}")
    free = np.bincount(np.asarray(owners, dtype=np.int64), minlength=world)
    placed = np.zeros(world)
    new = [-1] * len(owners)
    for e in sorted(range(len(owners)), key=lambda e: (-loads[e], e)):
        d = min((d for d in range(world) if free[d] > 0),
                key=lambda d: (placed[d], d != owners[e], d))
        new[e] = d
        free[d] -= 1
        placed[d] += loads[e]
    return new


def replacement(loads, owners, world: int) -> list[int]:
    """:func:`balanced_owners` if it lowers the predicted most-loaded rank, else ``owners``."""
    owners = [int(r) for r in owners]
    new = balanced_owners(loads, owners, world)
    if rank_loads(loads, new, world).max() < rank_loads(loads, owners, world).max():
        return new
    return owners


def replace(model: nn.Module, optimizer) -> list[list[int]]:
    """Re-place the experts of every FSSDP layer of ``model`` from its load window and move
    parameters and optimizer state (collective over the FSSDP group; every rank must call it
    at the same step). Layers without loads yet keep their owners. Returns the owners."""
    layers = fssdp_layers(model)
    if any(m.slots is not layers[0].slots for m in layers):
        raise ConfigError("replace needs the FSSDP layers to share one slot tensor "
                          "(moeflow.strategies.fssdp.reshard.share_slots; the GPT does it)")
    new = []
    for m in layers:
        est = m.window.estimate()
        cur = list(m.owners.owners)
        new.append(cur if est is None else replacement(est, cur, m.world))
    if layers:
        apply_owners(model, optimizer, new)       # nothing moves when nothing changed
    return new


def maybe_replace(model: nn.Module, optimizer, step: int) -> bool:
    """Re-place every ``fssdp.replace_every`` optimizer steps (the first FSSDP layer's option;
    0 = never). True when this step re-placed (experts may or may not have moved)."""
    if not due(model, step, "replace_every"):
        return False
    replace(model, optimizer)
    return True


__all__ = ["balanced_owners", "maybe_replace", "rank_loads", "replace", "replacement"]
