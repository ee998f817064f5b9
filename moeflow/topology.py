"""Ranks as nodes x local ranks, and the process groups every part of moeflow communicates on.

Rank ``r`` lives on node ``r // local_size`` as local rank ``r % local_size`` (torchrun's
numbering). Expert parallelism (EP) groups are blocks of ``ep_size`` consecutive ranks; the
expert-data-parallel group of a rank holds the ranks at the same position in the other EP
groups (they hold the same experts). Groups are created once per (world, ep_size, local_size)
and reused: ``torch.distributed.new_group`` is collective, so every rank creates every group in
the same order here and nowhere else. Every subgroup gets the world group's backend configuration
(``cpu:gloo,cuda:nccl`` on GPUs, see :mod:`moeflow.devices`), so CPU tensors (timings, counts)
and device tensors both travel on every group. Every communicator exists once the topology is
built (:func:`connect_eagerly`): none is formed lazily by the first operation on a group.

Parm's layouts (``mp_size`` or ``esp_size`` > 1, Parm Section II-B and IV-A) are described by
two :func:`torch.distributed.device_mesh.init_device_mesh` meshes over the same ranks: the dense
mesh ``("dp", "mp")`` (MP = tensor parallelism, blocks of ``mp_size`` consecutive ranks, so
inside a node) and the expert mesh ``("edp", "ep", "esp")`` (ESP innermost: ESP groups in a
node, Section IV-A case 2) or ``("edp", "esp", "ep")`` (EP innermost: case 3), chosen by
``esp_in_node``. EP x ESP blocks are consecutive; their union is the EP&ESP group (the mesh's
``ep``/``esp`` dimensions flattened), and ``edp`` holds the ranks that keep the same expert
shard. ``init_device_mesh`` builds every group with the world's backend configuration on gloo
and NCCL alike, and users of FSDP2 / torchtitan can take ``topo.mesh`` / ``topo.dense_mesh``.
The pure expert-parallel layout (``mp_size == esp_size == 1``) keeps its original groups
(``ep_group`` is the WORLD group when ``ep_size`` is the world), so nothing changes for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.devices import group_backend
from moeflow.errors import ConfigError

_CACHE: dict[tuple, "Topology"] = {}
GROUP_FIELDS = ("world_group", "ep_group", "expert_dp_group", "intra_node_group",
                "inter_node_group", "lane_group", "mp_group", "dp_group", "esp_group",
                "ep_esp_group")


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
    # Parm (strategies/parm): tensor (MP) and expert-sharding (ESP) parallelism
    mp_size: int = 1
    esp_size: int = 1
    esp_in_node: bool = True          # ESP innermost (Parm IV-A case 2); False: EP innermost
    mp_group: object = None
    dp_group: object = None           # ranks with the same MP rank (dense data parallel)
    esp_group: object = None
    ep_esp_group: object = None       # the union EP&ESP group (Parm Section III-C)
    mesh: object = None               # DeviceMesh ("edp", "ep", "esp") in placement order
    dense_mesh: object = None         # DeviceMesh ("dp", "mp")

    def groups(self) -> list:
        """This rank's distinct process groups, one order for every rank: kind by kind (each
        kind partitions the world, so a rank is in one group of each; the world group, where
        a kind is the whole world, at its first kind)."""
        out: list = []
        for name in GROUP_FIELDS:
            g = getattr(self, name)
            if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER and not any(
                    g is h for h in out):
                out.append(g)
        return out

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
    def expert_slots(self) -> int:
        """Ranks of one EP&ESP block: together they hold every expert once."""
        return self.ep_size * self.esp_size

    @property
    def expert_slot(self) -> int:
        """This rank's position in its EP&ESP block (= the global rank of the first rank of its
        expert-data-parallel group, which holds the same shard)."""
        return self.rank % self.expert_slots

    def slot_coords(self, slot: int) -> tuple[int, int]:
        """(ep_rank, esp_rank) of the rank at ``slot`` of an EP&ESP block."""
        if self.esp_in_node:
            return slot // self.esp_size, slot % self.esp_size
        return slot % self.ep_size, slot // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.slot_coords(self.expert_slot)[0]

    @property
    def esp_rank(self) -> int:
        return self.slot_coords(self.expert_slot)[1]

    @property
    def mp_rank(self) -> int:
        return self.rank % self.mp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.mp_size

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank: the ranks of one MP group share it (and their batch)."""
        return self.rank // self.mp_size

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // self.expert_slots

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def __repr__(self) -> str:
        parm = (f", mp={self.mp_size}, esp={self.esp_size} "
                f"({'esp' if self.esp_in_node else 'ep'} in node)"
                if self.mp_size > 1 or self.esp_size > 1 else "")
        return (f"Topology(rank={self.rank}, world={self.world_size}, nodes={self.num_nodes}"
                f"x{self.local_size}, ep={self.ep_size}{parm}, "
                f"expert_dp={self.expert_dp_size})")

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def single(cls) -> "Topology":
        """A world of one process: every group is trivial."""
        return cls(rank=0, world_size=1, local_size=1, ep_size=1)

    @classmethod
    def from_env(cls, ep_size: int | None = None, local_size: int | None = None, *,
                 mp_size: int = 1, esp_size: int = 1,
                 esp_in_node: bool = True) -> "Topology":
        """The topology of the running job.

        Call after ``torch.distributed.init_process_group`` (or without it, for a world of one).
        ``local_size`` (ranks per node) defaults to torchrun's ``LOCAL_WORLD_SIZE``, else the
        whole world is one node. ``ep_size`` defaults to the world size (pure expert
        parallelism: every expert lives on exactly one rank; with ``esp_size`` > 1, the world
        divided by ``esp_size``).

        Parm (see the module docstring): ``mp_size`` ranks share one replicated MoE input (tensor
        parallelism of the dense layers); ``esp_size`` ranks hold the shards of the same experts;
        ``esp_in_node`` puts the ESP groups inside a node (Parm IV-A case 2), else the EP groups
        (case 3).
        """
        if not (dist.is_available() and dist.is_initialized()):
            if (ep_size or 1) != 1 or (local_size or 1) != 1 or mp_size != 1 or esp_size != 1:
                raise ConfigError(
                    f"Topology.from_env(ep_size={ep_size}, local_size={local_size}, "
                    f"mp_size={mp_size}, esp_size={esp_size}) without an initialised "
                    "torch.distributed: a world of one has every size 1; call "
                    "torch.distributed.init_process_group first (torchrun sets it up)")
            return cls.single()
        world, rank = dist.get_world_size(), dist.get_rank()
        if local_size is None:
            local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if ep_size is None:
            ep_size = world // esp_size if esp_size > 0 and world % esp_size == 0 else world
        if local_size <= 0 or world % local_size:
            raise ConfigError(f"Topology local_size={local_size} is invalid: it must divide the "
                              f"world size {world} (nodes x ranks per node)")
        if ep_size <= 0 or world % ep_size:
            raise ConfigError(f"Topology ep_size={ep_size} is invalid: it must divide the world "
                              f"size {world}; pick one of "
                              f"{[d for d in range(1, world + 1) if world % d == 0]}")
        if mp_size != 1 or esp_size != 1:
            return _parm_topology(world, rank, local_size, ep_size, mp_size, esp_size,
                                  bool(esp_in_node))
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
            connect_eagerly(topo)
        _CACHE[key] = topo
        return topo


def eager_device():
    """Where :func:`connect_eagerly` must form communicators, or None when nothing is lazy:
    gloo connects a group when it is created, and NCCL does too when the world group is bound
    to a device (``init_process_group(device_id=...)``, as :func:`moeflow.launch.init_from_env`
    does). Left: NCCL in the backend of a job initialised without ``device_id``."""
    if "nccl" not in (group_backend() or ""):
        return None
    if getattr(dist.group.WORLD, "bound_device_id", None) is not None:
        return None
    return torch.device("cuda", torch.cuda.current_device())


def connect_eagerly(topo: Topology, device=None) -> int:
    """Form every group's communicator now: one one-element all-reduce per group of this rank,
    in :meth:`Topology.groups` order (the same kinds in the same order on every rank, so two
    ranks that share two groups warm them in the same order, and no rank waits for a peer
    warming another group first). Without it NCCL forms a communicator at the group's first
    operation: a rank whose first batched point-to-point on a group is empty (nothing to send
    or receive, so it issues nothing) leaves its peers waiting there. Bounded by each group's
    timeout (NCCL's watchdog). Returns the number of groups warmed (0 where nothing is lazy)."""
    device = eager_device() if device is None else device
    if device is None:
        return 0
    groups = topo.groups()
    for g in groups:
        dist.all_reduce(torch.zeros(1, device=device), group=g)
    return len(groups)


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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_parm_layout(world: int, local: int, ep: int, mp: int, esp: int,
                      esp_in_node: bool) -> None:
    """Raise ConfigError naming the size, the world and the fix when a layout can't be placed
    (also called by ``moeflow train`` before any rank starts)."""
    sizes = f"(world {world} = {world // local} nodes x {local} ranks)"
    for name, v in (("mp_size", mp), ("esp_size", esp)):
        if v <= 0 or world % v:
            raise ConfigError(f"Topology {name}={v} is invalid: it must divide the world size "
                              f"{world}; pick one of {_divisors(world)}")
    if world % (ep * esp):
        raise ConfigError(
            f"Topology ep_size={ep} x esp_size={esp} = {ep * esp} is invalid: EP&ESP blocks "
            f"must divide the world size {world}; pick ep_size from "
            f"{_divisors(world // esp)} for esp_size={esp}")
    if not (local % mp == 0 or mp % local == 0):
        raise ConfigError(
            f"Topology mp_size={mp} cannot be placed {sizes}: an MP group must sit inside one "
            f"node (mp_size dividing the {local} ranks per node) or span whole nodes; pick "
            f"mp_size from {_divisors(local)}")
    inner, name, case = (esp, "esp_size", 2) if esp_in_node else (ep, "ep_size", 3)
    if esp > 1 and local % inner:
        other = "False (EP groups in a node)" if esp_in_node else "True (ESP groups in a node)"
        raise ConfigError(
            f"Topology {name}={inner} cannot be placed {sizes} with esp_in_node={esp_in_node}: "
            f"Parm's placement (Section IV-A case {case}) needs each such group inside one "
            f"node, so {name} must divide {local}; use esp_in_node={other} or a {name} "
            f"from {_divisors(local)}")


def _parm_topology(world: int, rank: int, local: int, ep: int, mp: int, esp: int,
                   esp_in_node: bool) -> Topology:
    """The MP+EP+ESP topology, its groups taken from two DeviceMeshes (module docstring)."""
    check_parm_layout(world, local, ep, mp, esp, esp_in_node)
    key = (id(dist.group.WORLD), world, ep, local, mp, esp, esp_in_node)
    if key in _CACHE:
        return _CACHE[key]
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if "cuda:nccl" in (group_backend() or "") else "cpu"
    edp = world // (ep * esp)
    inner = ("esp", "ep") if esp_in_node else ("ep", "esp")
    shape = {"ep": ep, "esp": esp}
    mesh = init_device_mesh(device_type, (edp, shape[inner[1]], shape[inner[0]]),
                            mesh_dim_names=("edp", inner[1], inner[0]))
    dense = init_device_mesh(device_type, (world // mp, mp), mesh_dim_names=("dp", "mp"))
    union = mesh[inner[1], inner[0]]._flatten("ep_esp")
    topo = Topology(rank=rank, world_size=world, local_size=local, ep_size=ep,
                    world_group=dist.group.WORLD, ep_group=mesh.get_group("ep"),
                    expert_dp_group=mesh.get_group("edp"),
                    intra_node_group=_partition(world, rank, local, consecutive=True),
                    inter_node_group=_partition(world, rank, world // local, consecutive=False),
                    lane_group=dist.new_group(list(range(world)), backend=group_backend()),
                    mp_size=mp, esp_size=esp, esp_in_node=esp_in_node,
                    mp_group=dense.get_group("mp"), dp_group=dense.get_group("dp"),
                    esp_group=mesh.get_group("esp"), ep_esp_group=union.get_group(),
                    mesh=mesh, dense_mesh=dense)
    connect_eagerly(topo)
    _CACHE[key] = topo
    return topo
