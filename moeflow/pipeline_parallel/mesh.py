"""The device mesh of pipeline parallelism, in one of two placements of the pipeline ranks on
the nodes (``--pp-layout``):

- ``across-nodes`` (default): ``("pp", "edp", "ep")``, pipeline stages outermost, so the ranks
  of one pipeline rank (a *stage group*) are a consecutive block of ``world / pp`` ranks and
  fill whole nodes or sit inside one: the pipeline's point-to-point sends cross the nodes, the
  MoE all-to-all stays inside them (Megatron-LM, Narayanan et al. 2021 Section 3: the
  parallelism with the most traffic inside a node, the pipeline across).
- ``within-nodes``: ``("edp", "ep", "pp")``, pipeline stages innermost, so a stage group is
  strided over the ranks (global rank ``stage_rank x pp + pp_rank``), each node holds whole
  pipelines, and the all-to-all of a stage crosses the nodes while the sends stay inside them
  (the other way round; DeepSeek-V3 Section 3.2 runs its expert parallelism across nodes).

Inside a stage group, the expert-parallel layout of :mod:`moeflow.topology` (EP groups of
``ep_size`` consecutive stage ranks, expert-data-parallel groups strided). The stages' MoE
layers get a :class:`~moeflow.topology.Topology` whose world is their stage group (Narayanan et
al. 2021 Section 2.3: pipeline across, the other parallelisms inside a stage), whose node size
is the stage's ranks per node, so an all-to-all, a router-bias all-reduce or a gradient
synchronisation stays inside the stage.

The tied token embedding lives on the first and on the last stage; where those are different
pipeline ranks (gpipe, 1f1b, interleaved-1f1b), each stage-local rank position has a *tie
group* of its two copies, over which their gradients are summed (Megatron-LM's embedding
group, Shoeybi et al. 2019 Section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from moeflow.config.training import PP_LAYOUTS
from moeflow.devices import group_backend
from moeflow.errors import ConfigError
from moeflow.topology import Topology, connect_eagerly


@dataclass(frozen=True, eq=False)
class PipelineMesh:
    pp_size: int
    pp_rank: int
    pp_group: object           # this stage-local position's ranks, one per pipeline rank
    stage: Topology            # this pipeline rank's ranks as a world of their own
    mesh: object               # DeviceMesh ("pp", "edp", "ep") or ("edp", "ep", "pp")
    tie_group: object = None   # first and last pipeline rank at this position (None: V)
    layout: str = "across-nodes"


def stage_size(world: int, pp: int) -> int:
    if pp < 1 or world % pp:
        raise ConfigError(f"--pp {pp} is invalid with {world} ranks: it must divide the number "
                          f"of ranks; pick one of "
                          f"{[d for d in range(1, world + 1) if world % d == 0]}")
    return world // pp


def _check_layout(layout: str) -> None:
    if layout not in PP_LAYOUTS:
        raise ConfigError(f"--pp-layout {layout!r} is invalid: choose one of "
                          f"{', '.join(PP_LAYOUTS)}")


def global_rank(pp_rank: int, stage_rank: int, world: int, pp: int,
                layout: str = "across-nodes") -> int:
    """The global rank of position ``stage_rank`` in pipeline rank ``pp_rank``'s stage group."""
    _check_layout(layout)
    if layout == "across-nodes":
        return pp_rank * stage_size(world, pp) + stage_rank
    return stage_rank * pp + pp_rank


def pipeline_coords(rank: int, world: int, pp: int,
                    layout: str = "across-nodes") -> tuple[int, int]:
    """``(pp_rank, stage_rank)`` of global ``rank``."""
    _check_layout(layout)
    size = stage_size(world, pp)
    if layout == "across-nodes":
        return divmod(rank, size)
    return rank % pp, rank // pp


def stage_dp_rank(rank: int, world: int, pp: int, layout: str = "across-nodes") -> int:
    """The data-parallel rank of global ``rank``: its position in its stage group (the ranks
    of one stage-local position share a batch, which flows through their stages)."""
    return pipeline_coords(rank, world, pp, layout)[1]


def stage_ranks_per_node(world: int, pp: int, local: int, layout: str = "across-nodes") -> int:
    """How many ranks of one stage group a node of ``local`` ranks holds; ``ConfigError``
    naming the flags where the layout cannot be placed on such nodes."""
    _check_layout(layout)
    size = stage_size(world, pp)
    if layout == "across-nodes":
        if not (size % local == 0 or local % size == 0):
            raise ConfigError(f"--pp {pp} --pp-layout across-nodes cannot be placed on nodes of "
                              f"{local} ranks: a stage of {size} ranks must fill whole nodes "
                              f"or sit inside one; use --pp-layout within-nodes or another --pp")
        return min(local, size)
    if local % pp:
        raise ConfigError(f"--pp {pp} --pp-layout within-nodes cannot be placed on nodes of "
                          f"{local} ranks: each node must hold whole pipelines of {pp} ranks; "
                          f"use --pp-layout across-nodes or a --pp dividing {local}")
    return local // pp


def _stage_groups(world: int, rank: int, pp: int, layout: str, group: int,
                  consecutive: bool):
    """Split every stage group into groups of ``group`` stage-local ranks (``consecutive``
    blocks of stage ranks, else strided); the one holding ``rank``. Every rank creates every
    group, in one order (``new_group`` is collective)."""
    mine = None
    size = stage_size(world, pp)
    n = size // group
    for p in range(pp):
        for g in range(n):
            local = (range(g * group, (g + 1) * group) if consecutive
                     else range(g, size, n))
            ranks = [global_rank(p, r, world, pp, layout) for r in local]
            pg = dist.new_group(ranks, backend=group_backend())
            if rank in ranks:
                mine = pg
    return mine


def build_pipeline_mesh(pp: int, ep_size: int | None, tied_across_ranks: bool,
                        local_size: int | None = None,
                        layout: str = "across-nodes") -> PipelineMesh:
    """The mesh, the groups and the stage topology of this rank (torch.distributed
    initialised). ``ep_size``: the EP group size inside a stage (None: the whole stage).
    ``tied_across_ranks``: the first and last stage are on different pipeline ranks (build the
    tie groups). ``local_size``: ranks per node (torchrun's ``LOCAL_WORLD_SIZE``).
    ``layout``: ``across-nodes`` or ``within-nodes`` (the module's docstring)."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    _check_layout(layout)
    world, rank = dist.get_world_size(), dist.get_rank()
    size = stage_size(world, pp)
    ep = ep_size or size
    if size % ep:
        raise ConfigError(f"--ep-size {ep} is invalid with --pp {pp} on {world} ranks: the EP "
                          f"groups live inside a stage of {size} ranks; pick one of "
                          f"{[d for d in range(1, size + 1) if size % d == 0]}")
    local = local_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    stage_local = stage_ranks_per_node(world, pp, local, layout)
    device_type = "cuda" if "cuda:nccl" in (group_backend() or "") else "cpu"
    if layout == "across-nodes":
        mesh = init_device_mesh(device_type, (pp, size // ep, ep),
                                mesh_dim_names=("pp", "edp", "ep"))
    else:
        mesh = init_device_mesh(device_type, (size // ep, ep, pp),
                                mesh_dim_names=("edp", "ep", "pp"))
    stage_group = mesh["edp", "ep"]._flatten("stage").get_group()
    pp_rank, stage_rank = pipeline_coords(rank, world, pp, layout)
    stage = Topology(
        rank=stage_rank, world_size=size, local_size=stage_local, ep_size=ep,
        world_group=stage_group, ep_group=mesh.get_group("ep"),
        expert_dp_group=mesh.get_group("edp"),
        intra_node_group=_stage_groups(world, rank, pp, layout, stage_local, consecutive=True),
        inter_node_group=_stage_groups(world, rank, pp, layout, size // stage_local,
                                       consecutive=False),
        lane_group=_stage_groups(world, rank, pp, layout, size, consecutive=True))
    tie = None
    if tied_across_ranks:
        for s in range(size):
            ranks = [global_rank(0, s, world, pp, layout),
                     global_rank(pp - 1, s, world, pp, layout)]
            g = dist.new_group(ranks, backend=group_backend())
            if rank in ranks:
                tie = g
    connect_eagerly(stage)
    return PipelineMesh(pp_size=pp, pp_rank=pp_rank, pp_group=mesh.get_group("pp"),
                        stage=stage, mesh=mesh, tie_group=tie, layout=layout)
