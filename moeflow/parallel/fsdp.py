"""FSDP2 for the dense part of the GPT: ``torch.distributed.fsdp.fully_shard`` on the
non-expert modules over the data-parallel dimension (``TrainConfig.dense_shard="fsdp"``,
``moeflow train --dense-shard fsdp``; docs/training.md, "Sharding the dense part with FSDP2").

FSDP2 (torch >= 2.4; ZeRO-3 / PyTorch FSDP, Zhao et al., VLDB 2023, Section 3) turns each
wrapped module's parameters into ``DTensor`` shards ``Shard(0)`` over a 1-D mesh: a rank keeps
1/D of each dense weight, its gradient and its AdamW moments; a module's parameters are
all-gathered before its forward (and again before its backward) and freed after, and the
gradients are reduce-scattered in backward, averaged over the mesh. Here the mesh is the dense
data-parallel dimension (:func:`dense_dp_mesh`): ``topo.dense_mesh["dp"]`` where Parm built one,
else a ``("dp",)`` mesh over a process group of its own that spans the world (not the world
group itself: a 1-D ``init_device_mesh`` over the world returns the default group, so FSDP2's
all-gathers and reduce-scatters would queue on the NCCL stream of the experts' all-to-alls).

Under bf16 autocast (:func:`shard_dense` with ``param_dtype=torch.bfloat16``) FSDP2 gets a
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (ZeRO's mixed precision,
Rajbhandari et al., SC 2020, Section 3; FSDP, Zhao et al., Section 4.3): it all-gathers the
dense weights in bf16 (half the bytes; autocast would cast them to bf16 for the matmuls anyway)
and reduce-scatters the gradients in fp32; the sharded master weights and AdamW moments stay
fp32. Each MoE layer's router stays out of FSDP2 there (``ignored_params``: a plain fp32
tensor, replicated, its gradient averaged by :func:`~moeflow.parallel.grad_sync.sync_gradients`
as without FSDP2; ``d_model x E`` values), so the routing still computes from fp32 weights (the
router runs with autocast off, docs/gpu.md).

Refused (:func:`check_lane_overlap`): HECATE FSSDP's ``overlap_backward`` / ``overlap_regather``,
whose spRS / re-gather run on the layer's communication lane during the attention backward,
while the autograd thread issues FSDP2's reduce-scatters and prefetch all-gathers: two threads
issuing collectives in an order that can differ per rank (docs/design.md, "One collective
order per rank").

What is sharded: every block (its attention, layer norms, dense MLP, and in an MoE block the
router, the BigMac projections and the shared experts) and, at the root, the token and position
embeddings (the tied head) and the final norm. The experts are not: their parameters
(``EXPERT_PARAM_ATTR``: EP stacks, Parm's ESP shards, HECATE's FSSDP slot tensor) are passed
as ``ignored_params``, so they stay plain tensors under expert parallelism / FSSDP, and
:func:`~moeflow.parallel.grad_sync.sync_gradients` still averages them over the
expert-data-parallel group. A parameter FSDP2 manages is a ``DTensor``
(:func:`is_fsdp_param`): the gradient sync, the replica check, the clipping norm and the
checkpoint recognise it by that.

The column-parallel ``qkv`` weight is stored in checkpoints in its ``(3, d_model, d_model)``
view (:mod:`moeflow.checkpoint`); it is sharded on its input dimension (``Shard(1)``) so that
the view stays an alias of the local shard and DCP reads into it in place.

With Parm's tensor parallelism (``mp_size > 1``, Megatron-LM's f/g layers of
:mod:`moeflow.parallel.tensor_parallel`) an MP rank's dense parameters are ordinary local
tensors: its MP shard of ``qkv`` / ``proj`` / ``up`` / ``down``, or a tensor replicated over the
MP group (embeddings, layer norms, router). Each is sharded over this rank's data-parallel
sub-mesh ``topo.dense_mesh["dp"]`` (the ranks with the same MP rank), on a dimension the MP
split leaves whole (:func:`_placement_fn`: a column-parallel weight on its input dimension, a
row-parallel one on its output dimension), so that a rank's piece is one block of the global
weight over the 2-D (DP, MP) mesh, which the checkpoint stores whole. FSDP2 averages gradients
over DP only: the MP-replicated parameters still get the all-reduce over the MP group that
:func:`~moeflow.parallel.grad_sync.sync_gradients` gives them without FSDP2 (their MP ranks
can hold different partial gradients, e.g. a router under Parm's S1), the MP shards need
none. A sharded MP shard keeps its :class:`~moeflow.parallel.tensor_parallel.TPShard`
(``TP_ATTR``), so the clipping norm counts each of its slices once over DP x MP.

Sharded from the start (:func:`init_meta_shards`, torchtitan's meta-device initialisation):
a model whose dense parameters are on the meta device is sharded by ``fully_shard`` without
values; each rank then gives each parameter its local shard and fills it with its slice of the
whole parameter's value, computed one parameter at a time on CPU, so no rank ever holds the
whole dense part (:mod:`moeflow.models.fsdp_build` builds the GPT that way).

"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from moeflow.errors import ConfigError
from moeflow.experts.ffn import EXPERT_PARAM_ATTR
from moeflow.topology import Topology

_MESHES: dict[tuple, object] = {}


def is_fsdp_param(p: torch.Tensor) -> bool:
    """A parameter FSDP2 shards (a DTensor): FSDP2 reduces its gradient itself."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _device_type() -> str:
    from moeflow.devices import group_backend

    return "cuda" if "cuda:nccl" in (group_backend() or "") else "cpu"


def dense_dp_mesh(topo: Topology):
    """The 1-D data-parallel DeviceMesh of the dense layers: ``topo.dense_mesh["dp"]`` when
    the topology has a dense mesh (Parm's layouts) whose "dp" group is not the world group
    (``mp_size > 1``), else a ``("dp",)`` mesh over the world,
    built once per world (collectively: every rank calls this in the same order) on a process
    group of its own, so FSDP2's all-gathers and reduce-scatters never share a communicator
    with the experts' all-to-alls."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    # Parm's dense mesh with mp_size = 1 spans the world on "dp": torch then hands out the
    # default group itself, so it gets a group of its own below like the 1-D case
    if topo.dense_mesh is not None and topo.dense_mesh["dp"].get_group() is not dist.group.WORLD:
        return topo.dense_mesh["dp"]

    key = (id(dist.group.WORLD), topo.world_size)
    if key not in _MESHES:
        # a group of its own (every rank creates it, in the same order): not WORLD
        group = dist.new_group(list(range(topo.world_size)))
        mesh = DeviceMesh.from_group(group, _device_type(), mesh_dim_names=("dp",))
        if _device_type() == "cuda":                 # form the communicator now, not lazily
            dist.all_reduce(torch.zeros(1, device="cuda"), group=mesh.get_group())
        _MESHES[key] = mesh
    return _MESHES[key]


def expert_params(module: nn.Module) -> set[nn.Parameter]:
    """The expert parameters under ``module`` (kept out of FSDP2)."""
    return {p for p in module.parameters() if getattr(p, EXPERT_PARAM_ATTR, False)}


def _placement_fn(model: nn.Module):
    """``Shard(1)`` for weights stored in checkpoints in a view that splits dimension 0
    (``qkv``'s ``(3, d_model, d_model)``) and for column-parallel weights split over MP (their
    output dimension is the MP split), FSDP2's default ``Shard(0)`` for the rest (a
    row-parallel weight's MP split is its input dimension)."""
    from torch.distributed.tensor import Shard

    from moeflow.parallel.tensor_parallel import ColumnParallelLinear

    split = {id(m.weight) for m in model.modules()
             if isinstance(m, ColumnParallelLinear)
             and (len(m.spec.view) != m.weight.dim() or m.spec.size > 1)}
    return lambda p: Shard(1) if id(p) in split else None


def _tp_modules(model: nn.Module) -> list[nn.Module]:
    """The tensor-parallel layers whose weight is an MP shard (``spec.size > 1``)."""
    from moeflow.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear,
                                                         RowParallelLinear))
            and m.spec.size > 1]


#: the HECATE options that put collectives on the lane during the backward (refused with FSDP2)
LANE_OVERLAP_OPTIONS = ("overlap_backward", "overlap_regather")


def check_lane_overlap(model: nn.Module) -> None:
    """Refuse FSDP2 on a model whose FSSDP layers run spRS / the re-gather on their lane during
    the backward (module docstring): a ``ConfigError`` naming the layer, the option and the
    fix. Every rank has the same config, so every rank refuses alike, before any collective."""
    for name, m in model.named_modules():
        opts = getattr(getattr(m, "cfg", None), "fssdp", None)
        for option in LANE_OVERLAP_OPTIONS:
            if getattr(opts, option, False):
                raise ConfigError(
                    f"--dense-shard fsdp: TrainConfig.dense_shard='fsdp' is invalid with "
                    f"MoEConfig.fssdp.{option}=True (MoE layer {name!r}): HECATE's lane would "
                    "issue its spRS / re-gather during the attention backward while FSDP2's "
                    "reduce-scatters and all-gathers run on the autograd thread, in an order "
                    f"that can differ per rank (a hang on NCCL); set fssdp.{option}=false or "
                    "use --dense-shard replicate")


def mixed_precision(param_dtype: torch.dtype | None):
    """FSDP2's policy for the run's autocast dtype: bf16 all-gathers and fp32 reduce-scatters
    under bf16, none (FSDP2's default: the parameters' own dtype) otherwise."""
    if param_dtype != torch.bfloat16:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _routers(model: nn.Module) -> list[nn.Module]:
    """The MoE layers' routers (kept out of FSDP2 under a bf16 policy: module docstring)."""
    return [m.router for m in model.modules()
            if isinstance(getattr(m, "router", None), nn.Module)
            and any(True for _ in m.router.parameters())]


def shard_dense(model: nn.Module, topo: Topology,
                param_dtype: torch.dtype | None = None) -> nn.Module:
    """Apply FSDP2 to ``model``'s dense part (module docstring), in place; returns ``model``.
    ``param_dtype``: the run's autocast dtype (bf16: the mixed-precision policy of the module
    docstring).

    Call after :func:`~moeflow.parallel.replicas.prepare_model` (the replicas are equal, so
    each rank's shard is its slice of the same weights) and before building the optimizer
    (it must step the sharded parameters). A world of one has nothing to shard: the model is
    returned as it is."""
    check_lane_overlap(model)
    if not topo.distributed:
        return model
    from torch.distributed.fsdp import fully_shard

    from moeflow.parallel.tensor_parallel import TP_ATTR

    mesh = dense_dp_mesh(topo)
    place = _placement_fn(model)
    tp = _tp_modules(model)
    policy = mixed_precision(param_dtype)
    extra = {} if policy is None else {"mp_policy": policy}
    # under the bf16 policy the routers stay out of FSDP2: plain fp32 replicated tensors
    keep = set() if policy is None else {p for r in _routers(model) for p in r.parameters()}
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh, ignored_params=(expert_params(block) | keep) or None,
                    shard_placement_fn=place, **extra)
    fully_shard(model, mesh=mesh, ignored_params=(expert_params(model) | keep) or None,
                shard_placement_fn=place, **extra)
    for m in tp:                  # FSDP2 made new parameters: the MP shards keep their spec
        setattr(m.weight, TP_ATTR, m.spec)
    return model


def local_slice(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``full`` as FSDP2 cut it for the sharded parameter ``p`` (a 1-D
    mesh, ``Shard(d)``: ``torch.chunk`` over the mesh, the last ranks' blocks possibly empty)."""
    (place,) = p.placements
    mesh = p.device_mesh
    chunks = torch.chunk(full, mesh.size(), dim=place.dim)
    rank = mesh.get_local_rank()
    if rank < len(chunks):
        return chunks[rank]
    shape = list(full.shape)
    shape[place.dim] = 0
    return full.new_empty(shape)


@torch.no_grad()
def init_meta_shards(model: nn.Module, initial_value: Callable[[str, tuple], torch.Tensor],
                     device: torch.device | str = "cpu",
                     dtype: torch.dtype | None = None) -> list[str]:
    """Give every FSDP2 parameter of ``model`` still on the meta device its local shard on
    ``device`` (in ``dtype``, or the parameter's), filled with its slice of
    ``initial_value(name, global_shape)``: the whole parameter's value, asked for one
    parameter at a time and dropped after its slice is copied (an MP shard of Parm's tensor
    parallelism: its MP block of it, then that block's DP slice). Call after :func:`shard_dense`
    on a model built with its dense part on the meta device. Returns the names filled.

    A meta parameter that FSDP2 does not manage (not a DTensor) is refused: it would have to be
    materialised whole."""
    from torch.distributed.tensor import DTensor

    meta = [(n, p) for n, p in model.named_parameters() if p.is_meta]
    plain = [n for n, p in meta if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(f"init_meta_shards: {plain[:3]} are on the meta device but not "
                         "sharded by FSDP2 (plain tensors); call shard_dense(model, topo) "
                         "first, or build them on a real device")
    names = {n for n, _ in meta}

    def empty(t: torch.Tensor) -> torch.Tensor:        # the real tensors are kept as they are
        if not t.is_meta:
            return t
        return torch.empty_like(t, device=device, dtype=dtype if t.is_floating_point()
                                else None)

    from moeflow.parallel.tensor_parallel import TP_ATTR, shard_of, tp_shard

    # an MP shard (Parm's tensor parallelism) keeps its spec on the new parameter object
    specs = {n: tp_shard(p) for n, p in model.named_parameters() if tp_shard(p) is not None}
    model._apply(empty)          # FSDPModule._apply re-pads and re-registers the local shards
    for name, p in model.named_parameters():
        if name in specs:
            setattr(p, TP_ATTR, specs[name])
        if name in names:
            spec = specs.get(name)   # an MP shard: its MP block of the value first
            full = initial_value(name, spec.global_shape if spec else tuple(p.shape))
            if spec is not None:
                full = shard_of(full, spec)
            local = p.to_local()
            part = local_slice(full, p)
            if part.shape != local.shape:
                raise RuntimeError(f"init_meta_shards: {name}'s slice {tuple(part.shape)} "
                                   f"differs from its local shard {tuple(local.shape)}")
            local.copy_(part)
            del full, part
    return sorted(names)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2's reduce-scatter after this backward on (the last micro-batch of a step) or off
    (the others: the unsharded gradients accumulate and are reduced once); no-op without
    FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
