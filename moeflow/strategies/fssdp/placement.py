"""One MoE layer's expert placement under FSSDP (HECATE, Sections 3.1, 3.2 and 4.2).

Two chunk placements describe a layer, with each expert as one chunk (Section 4.2:
``P = E x D``, every expert's parameters one chunk of the logical buffer):

* the **owner shard map** ``P`` (Section 3.2, "sharding phase"): every expert has exactly one
  owning rank, which keeps its parameters and optimizer state. Sharding is heterogeneous
  (Section 4.3): a rank may own any number of experts, none included.
* the **materialized placement** ``P'`` (Section 3.2, "materialization phase"): the set of ranks
  holding each expert this iteration. ``P ⊆ P'`` (spAG's condition, Section 3.1), so the owner
  always holds its expert.

Static expert parallelism is the special case ``P' = P`` (:meth:`Placement.static`).
Invalid placements raise :class:`moeflow.errors.ConfigError` naming the expert and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from moeflow.errors import ConfigError


def _check_rank(r, world_size: int, what: str) -> int:
    if isinstance(r, bool) or not isinstance(r, int):
        raise ConfigError(f"{what}={r!r} is invalid: a rank must be an int in "
                          f"[0, {world_size})")
    if not 0 <= r < world_size:
        raise ConfigError(f"{what}={r} is invalid: ranks are 0..{world_size - 1} "
                          f"(world size {world_size})")
    return r


@dataclass(frozen=True)
class Placement:
    """Owners ``owners[e]`` (``P``) and holders ``holders[e]`` (``P'``) of a layer's experts."""

    world_size: int
    owners: tuple[int, ...]
    holders: tuple[frozenset[int], ...]

    def __init__(self, owners: Sequence[int], holders: Sequence[Iterable[int]] | None = None,
                 *, world_size: int):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"Placement world_size={world_size!r} is invalid: it must be an "
                              "int >= 1")
        owners = tuple(owners)
        if not owners:
            raise ConfigError("Placement owners=() is invalid: a layer needs at least one expert")
        for e, r in enumerate(owners):
            _check_rank(r, world_size, f"Placement owners[{e}]")
        if holders is None:
            holders = [(r,) for r in owners]
        holders = tuple(holders)
        if len(holders) != len(owners):
            raise ConfigError(f"Placement holders has {len(holders)} entries for {len(owners)} "
                              "experts: give one set of ranks per expert")
        frozen = []
        for e, hs in enumerate(holders):
            hs = frozenset(_check_rank(r, world_size, f"Placement holders[{e}] rank")
                           for r in hs)
            if owners[e] not in hs:
                raise ConfigError(f"Placement holders[{e}]={sorted(hs)} is invalid: it must "
                                  f"contain the expert's owner {owners[e]} (P ⊆ P', HECATE "
                                  "Section 3.1); add the owner to the set")
            frozen.append(hs)
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "holders", tuple(frozen))

    # -- constructors -----------------------------------------------------------------------
    @classmethod
    def static(cls, owners: Sequence[int], world_size: int) -> "Placement":
        """Expert parallelism: every expert held by its owner only (``P' = P``)."""
        return cls(owners, None, world_size=world_size)

    @classmethod
    def even(cls, num_experts: int, world_size: int) -> "Placement":
        """The trivial sharding (Section 3.2): contiguous, equal blocks of experts per rank."""
        if num_experts < 1 or num_experts % world_size:
            raise ConfigError(f"Placement.even num_experts={num_experts} is invalid: it must be "
                              f"a positive multiple of the world size {world_size}; give "
                              "explicit owners for a heterogeneous sharding")
        per = num_experts // world_size
        return cls.static([e // per for e in range(num_experts)], world_size)

    def materialize(self, holders: Sequence[Iterable[int]]) -> "Placement":
        """The same owners with a new materialized placement ``P'``."""
        return Placement(self.owners, holders, world_size=self.world_size)

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return len(self.owners)

    @property
    def is_static(self) -> bool:
        """True when ``P' = P`` (static expert parallelism)."""
        return all(len(h) == 1 for h in self.holders)

    def owned(self, rank: int) -> list[int]:
        """Experts whose parameters and optimizer state live on ``rank``."""
        return [e for e, r in enumerate(self.owners) if r == rank]

    def held(self, rank: int) -> list[int]:
        """Experts materialized on ``rank`` this iteration (owned ones included)."""
        return [e for e, h in enumerate(self.holders) if rank in h]

    def replicas(self, rank: int) -> list[int]:
        """Experts ``rank`` holds without owning them (spAG receives them, spRS returns them)."""
        return [e for e, h in enumerate(self.holders) if rank in h and self.owners[e] != rank]

    def owner_chunks(self) -> list[frozenset[int]]:
        """``P`` as a chunk placement (one holder per chunk) for :mod:`moeflow.comm.sparse`."""
        return [frozenset((r,)) for r in self.owners]

    def holder_chunks(self) -> list[frozenset[int]]:
        """``P'`` as a chunk placement for :mod:`moeflow.comm.sparse`."""
        return list(self.holders)


__all__ = ["Placement"]
