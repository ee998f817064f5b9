"""Process groups per holder set, for HECATE's grouped-broadcast sparse collectives.

HECATE Section 3.1 / Section 5 ("Implementation"): the prototype runs ``spAG`` as one Broadcast
per chunk from its owner to the chunk's holders and ``spRS`` as the mirror Reduce, each in a
process group made of exactly those ranks. A holder set is a set of ranks of a parent group;
:class:`HolderGroups` creates one ``torch.distributed`` group per distinct set and caches it,
keyed by the set's parent-group ranks. The parent must span the world (FSSDP's group does).

``new_group`` is a collective over the whole world: every rank must create the same groups in
the same order, members or not. :meth:`HolderGroups.ensure` therefore takes every set the
collective will use (every rank knows the full placements, so every rank passes the same
ones) and creates the missing ones in sorted order; each creation is bounded by the parent
group's timeout. A world of ``n`` ranks has at most ``2^n - n - 1`` sets of two or more ranks,
so the cache stays bounded by ``max_groups`` (a clear error past it, never a hang: every rank
reaches the same decision from the same sets).

On CUDA each group is an NCCL communicator, formed eagerly (``ncclCommSplit`` when the process
group is bound to a device, docs/gpu.md): every creation stops every rank of the world, and each
communicator pins device memory on each of its members for as long as the process lives (NCCL's
per-peer channel buffers: roughly ``NCCL_BUFFSIZE`` (4 MiB by default) per protocol buffer, per
channel, per connected peer; tens to a few hundred MiB per communicator on NVLink nodes, to be
measured: docs/gpu.md). So a cache on an NCCL-backed parent holds at most
:data:`CUDA_MAX_GROUPS` communicators (:func:`default_max_groups`), and ``transport="auto"``
considers the broadcast transport only for few, stable holder sets
(:func:`moeflow.strategies.fssdp.transport.broadcast_candidate`).
"""

from __future__ import annotations

import datetime
from typing import Iterable

import torch.distributed as dist

DEFAULT_MAX_GROUPS = 256       # host (gloo) groups: cheap, bounded by the world's sets
CUDA_MAX_GROUPS = 16           # NCCL communicators: device memory each (module docstring)


def default_max_groups(parent=None) -> int:
    """The cache's bound for ``parent``'s backend: :data:`CUDA_MAX_GROUPS` when it carries NCCL,
    else :data:`DEFAULT_MAX_GROUPS`."""
    from moeflow.devices import group_backend

    return CUDA_MAX_GROUPS if "nccl" in (group_backend(parent) or "") else DEFAULT_MAX_GROUPS


class HolderGroupsError(RuntimeError):
    """More distinct holder sets than the cache allows."""


_SHARED: dict[int, "HolderGroups"] = {}


def shared_holder_groups(parent, timeout: datetime.timedelta) -> "HolderGroups":
    """The process-wide cache for world-spanning parents (FSSDP's group and its lane group
    name the same ranks, and every FSSDP layer uses the same holder sets): one set of
    communicators for all of them."""
    world = id(dist.distributed_c10d._get_default_group())
    if world not in _SHARED:
        _SHARED[world] = HolderGroups(parent, timeout)
    return _SHARED[world]


class HolderGroups:
    """Cached process groups for holder sets of ``parent``'s ranks (keys: sorted tuples of
    parent-group ranks). ``timeout``: each creation's bound (the parent group's)."""

    def __init__(self, parent, timeout: datetime.timedelta, *,
                 max_groups: int | None = None):
        size = dist.get_world_size(parent)
        if size != dist.get_world_size():
            raise HolderGroupsError(
                f"the grouped-broadcast transport needs a parent group spanning the world "
                f"({dist.get_world_size()} ranks), got one of {size}: creating a holder set's "
                "group is a world collective that ranks outside the parent would not join; use "
                "transport='p2p'")
        self.parent = parent
        self.timeout = timeout
        self.max_groups = default_max_groups(parent) if max_groups is None else max_groups
        self.groups: dict[tuple[int, ...], object] = {}
        self.created = 0                 # groups created so far (tests, stats)

    def global_rank(self, rank: int) -> int:
        """A parent-group rank -> the global rank ``broadcast`` / ``reduce`` name."""
        if self.parent is None or self.parent is dist.group.WORLD:
            return rank
        return dist.get_global_rank(self.parent, rank)

    def missing(self, sets: Iterable[Iterable[int]]) -> list[tuple[int, ...]]:
        """The sets of two or more ranks that have no group yet (sorted keys)."""
        return sorted({tuple(sorted(s)) for s in sets if len(frozenset(s)) > 1}
                      - set(self.groups))

    def fits(self, sets: Iterable[Iterable[int]]) -> bool:
        """Whether :meth:`ensure` of ``sets`` stays within ``max_groups`` (the same answer on
        every rank: a function of the sets)."""
        return len(self.groups) + len(self.missing(sets)) <= self.max_groups

    def ensure(self, sets: Iterable[Iterable[int]]) -> None:
        """Collective over the world: create the groups of ``sets`` (of two or more ranks) not
        cached yet, in sorted order. Every rank must pass the same sets."""
        keys = self.missing(sets)
        if len(self.groups) + len(keys) > self.max_groups:
            raise HolderGroupsError(
                f"the grouped-broadcast transport needs {len(self.groups) + len(keys)} process "
                f"groups (one per distinct holder set), more than max_groups={self.max_groups}: "
                "use MoEConfig.fssdp.transport='p2p', which needs none")
        for key in keys:
            ranks = [self.global_rank(r) for r in key]
            self.groups[key] = dist.new_group(ranks, timeout=self.timeout)
            self.created += 1

    def get(self, ranks: Iterable[int]):
        """The cached group of a holder set (created by :meth:`ensure`)."""
        key = tuple(sorted(ranks))
        try:
            return self.groups[key]
        except KeyError:
            raise HolderGroupsError(f"no process group for holder set {list(key)}: call "
                                    "ensure() with it on every rank first") from None


__all__ = ["CUDA_MAX_GROUPS", "DEFAULT_MAX_GROUPS", "HolderGroups", "default_max_groups",
           "HolderGroupsError", "shared_holder_groups"]
