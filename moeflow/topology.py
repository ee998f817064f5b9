"""Ranks as nodes x local ranks, and the process groups every part of moeflow communicates on.

Rank ``r`` lives on node ``r // local_size`` as local rank ``r % local_size`` (torchrun's
numbering). Expert parallelism (EP) groups are blocks of ``ep_size`` consecutive ranks; the
expert-data-parallel group of a rank holds the ranks at the same position in the other EP
groups (they hold the same experts). Groups are created once per (world, ep_size, local_size)
and reused: ``torch.distributed.new_group`` is collective, so every rank creates every group in
the same order here and nowhere else. Every subgroup gets the world group's backend configuration
(``cpu:gloo,cuda:nccl`` on GPUs, see :mod:`moeflow.devices`), so CPU tensors (timings, counts)
and device tensors both travel on every group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from moeflow.devices import group_backend
from moeflow.errors import ConfigError

_CACHE: dict[tuple, "Topology"] = {}


@dataclass(frozen=True, eq=False)
class Topology:
    rank: int
    world_size: int
    local_size: int
    ep_size: int
    world_group: object = None        # None when world_size == 1 (nothing to communicate)
    ep_group: object = None
    expert_dp_group: object = None
    intra_node_group: object = None
    inter_node_group: object = None
    lane_group: object = None         # a second world group: a concurrent lane (Pipe-A2A)

    # ---- derived coordinates -------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_size

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def __repr__(self) -> str:
        return (f"Topology(rank={self.rank}, world={self.world_size}, nodes={self.num_nodes}"
                f"x{self.local_size}, ep={self.ep_size}, expert_dp={self.expert_dp_size})")

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def single(cls) -> "Topology":
        """A world of one process: every group is trivial."""
        return cls(rank=0, world_size=1, local_size=1, ep_size=1)

    @classmethod
    def from_env(cls, ep_size: int | None = None, local_size: int | None = None) -> "Topology":
        """The topology of the running job.

        Call after ``torch.distributed.init_process_group`` (or without it, for a world of one).
        ``local_size`` (ranks per node) defaults to torchrun's ``LOCAL_WORLD_SIZE``, else the
        whole world is one node. ``ep_size`` defaults to the world size (pure expert
        parallelism: every expert lives on exactly one rank).
        """
        if not (dist.is_available() and dist.is_initialized()):
            if (ep_size or 1) != 1 or (local_size or 1) != 1:
                raise ConfigError(
                    f"Topology.from_env(ep_size={ep_size}, local_size={local_size}) without an "
                    "initialised torch.distributed: a world of one has ep_size=local_size=1; "
                    "call torch.distributed.init_process_group first (torchrun sets it up)")
            return cls.single()
        world, rank = dist.get_world_size(), dist.get_rank()
        if local_size is None:
            local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if ep_size is None:
            ep_size = world
        if local_size <= 0 or world % local_size:
            raise ConfigError(f"Topology local_size={local_size} is invalid: it must divide the "
                              f"world size {world} (nodes x ranks per node)")
        if ep_size <= 0 or world % ep_size:
            raise ConfigError(f"Topology ep_size={ep_size} is invalid: it must divide the world "
                              f"size {world}; pick one of "
                              f"{[d for d in range(1, world + 1) if world % d == 0]}")
        key = (id(dist.group.WORLD), world, ep_size, local_size)
        if key in _CACHE:
            return _CACHE[key]
        if world == 1:
            topo = cls.single()
        else:
            topo = cls(rank=rank, world_size=world, local_size=local_size, ep_size=ep_size,
                       world_group=dist.group.WORLD,
                       ep_group=_partition(world, rank, ep_size, consecutive=True),
                       expert_dp_group=_partition(world, rank, world // ep_size,
                                                  consecutive=False),
                       intra_node_group=_partition(world, rank, local_size, consecutive=True),
                       inter_node_group=_partition(world, rank, world // local_size,
                                                   consecutive=False),
                       lane_group=dist.new_group(list(range(world)),
                                                       backend=group_backend()))
        _CACHE[key] = topo
        return topo


def _partition(world: int, rank: int, size: int, consecutive: bool):
    """Split the world into groups of ``size``; return the group holding ``rank``.

    consecutive: groups are [0..size), [size..2size), ...; otherwise strided: {i, i+n, i+2n, ...}
    with n = world // size. Every rank creates every group (new_group is collective).
    """
    if size == world:
        return dist.group.WORLD
    n = world // size
    mine = None
    for g in range(n):
        ranks = (list(range(g * size, (g + 1) * size)) if consecutive
                 else list(range(g, world, n)))
        pg = dist.new_group(ranks, backend=group_backend())
        if rank in ranks:
            mine = pg
    return mine
