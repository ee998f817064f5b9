"""The device mesh of pipeline parallelism: ``("pp", "edp", "ep")``, pipeline stages outermost,
so the ranks of one pipeline rank (a *stage group*) are a consecutive block of ``world / pp``
ranks, and inside it the expert-parallel layout of :mod:`moeflow.topology` (EP groups of
``ep_size`` consecutive ranks, expert-data-parallel groups strided). The stages' MoE layers
get a :class:`~moeflow.topology.Topology` whose world is their stage group (Megatron-LM,
Narayanan et al. 2021 Section 2.3: pipeline across, the other parallelisms inside a stage), so
an all-to-all, a router-bias all-reduce or a gradient synchronisation stays inside the stage.

The tied token embedding lives on the first and on the last stage; where those are different
pipeline ranks (gpipe, 1f1b, interleaved-1f1b), each stage-local rank position has a *tie
group* of its two copies, over which their gradients are summed (Megatron-LM's embedding
group, Shoeybi et al. 2019 Section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from moeflow.devices import group_backend
from moeflow.errors import ConfigError
from moeflow.topology import Topology, connect_eagerly


@dataclass(frozen=True, eq=False)
class PipelineMesh:
    pp_size: int
    pp_rank: int
    pp_group: object           # this stage-local position's ranks, one per pipeline rank
    stage: Topology            # this pipeline rank's ranks as a world of their own
    mesh: object               # DeviceMesh ("pp", "edp", "ep")
    tie_group: object = None   # first and last pipeline rank at this position (None: V)


def stage_size(world: int, pp: int) -> int:
    if pp < 1 or world % pp:
        raise ConfigError(f"--pp {pp} is invalid with {world} ranks: it must divide the number "
                          f"of ranks; pick one of "
                          f"{[d for d in range(1, world + 1) if world % d == 0]}")
    return world // pp


def stage_dp_rank(rank: int, world: int, pp: int) -> int:
    """The data-parallel rank of global ``rank``: its position in its stage group (the ranks
    of one stage-local position share a batch, which flows through their stages)."""
    return rank % stage_size(world, pp)


def _stage_groups(world: int, rank: int, size: int, group: int, consecutive: bool):
    """Split every stage group (consecutive blocks of ``size`` ranks) into groups of
    ``group`` stage-local ranks (``consecutive`` blocks, else strided); the one holding
    ``rank``. Every rank creates every group, in one order (``new_group`` is collective)."""
    mine = None
    n = size // group
    for base in range(0, world, size):
        for g in range(n):
            local = (range(g * group, (g + 1) * group) if consecutive
                     else range(g, size, n))
            ranks = [base + r for r in local]
            pg = dist.new_group(ranks, backend=group_backend())
            if rank in ranks:
                mine = pg
    return mine


def build_pipeline_mesh(pp: int, ep_size: int | None, tied_across_ranks: bool,
                        local_size: int | None = None) -> PipelineMesh:
    """The mesh, the groups and the stage topology of this rank (torch.distributed
    initialised). ``ep_size``: the EP group size inside a stage (None: the whole stage).
    ``tied_across_ranks``: the first and last stage are on different pipeline ranks (build the
    tie groups). ``local_size``: ranks per node (torchrun's ``LOCAL_WORLD_SIZE``)."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    size = stage_size(world, pp)
    ep = ep_size or size
    if size % ep:
        raise ConfigError(f"--ep-size {ep} is invalid with --pp {pp} on {world} ranks: the EP "
                          f"groups live inside a stage of {size} ranks; pick one of "
                          f"{[d for d in range(1, size + 1) if size % d == 0]}")
    local = local_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not (size % local == 0 or local % size == 0):
        raise ConfigError(f"--pp {pp} cannot be placed on nodes of {local} ranks: a stage of "
                          f"{size} ranks must fill whole nodes or sit inside one")
    stage_local = min(local, size)
    device_type = "cuda" if "cuda:nccl" in (group_backend() or "") else "cpu"
    mesh = init_device_mesh(device_type, (pp, size // ep, ep),
                            mesh_dim_names=("pp", "edp", "ep"))
    stage_group = mesh["edp", "ep"]._flatten("stage").get_group()
    stage = Topology(
        rank=rank % size, world_size=size, local_size=stage_local, ep_size=ep,
        world_group=stage_group, ep_group=mesh.get_group("ep"),
        expert_dp_group=mesh.get_group("edp"),
        intra_node_group=_stage_groups(world, rank, size, stage_local, consecutive=True),
        inter_node_group=_stage_groups(world, rank, size, size // stage_local,
                                       consecutive=False),
        lane_group=_stage_groups(world, rank, size, size, consecutive=True))
    tie = None
    if tied_across_ranks:
        for s in range(size):
            ranks = [s, (pp - 1) * size + s]
            g = dist.new_group(ranks, backend=group_backend())
            if rank in ranks:
                tie = g
    connect_eagerly(stage)
    return PipelineMesh(pp_size=pp, pp_rank=rank // size, pp_group=mesh.get_group("pp"),
                        stage=stage, mesh=mesh, tie_group=tie)
