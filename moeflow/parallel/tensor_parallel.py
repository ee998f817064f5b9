"""Megatron-style tensor (model) parallelism of the dense layers over ``topo.mp_group``.

Parm (Section II-B) assumes the dense layers are tensor parallel over the MP group, so that the
input of every MoE layer is *replicated* in the MP group (it comes out of a row-parallel
all-reduce). This module gives the two linear layers of Megatron-LM (Shoeybi et al. 2019,
Section 3) and their conjugate operators:

* ``copy_to_mp`` (Megatron's ``f``): identity forward, all-reduce (sum) of the gradient
  backward. It stands before a column-parallel layer, whose replicated input gets partial
  gradients from each MP rank's columns.
* ``reduce_from_mp`` (Megatron's ``g``): all-reduce (sum) forward, identity backward. It ends a
  row-parallel layer, whose MP ranks hold partial sums of the output.

:class:`ColumnParallelLinear` holds a block of the output features (``parts`` blocks of equal
width, e.g. q, k, v, each split so an MP rank keeps whole heads of each);
:class:`RowParallelLinear` the matching block of the input features. Their weights are an exact
slice of the global ``nn.Linear`` weight (``shard_of``), so initial values stay
layout-independent, and each weight carries a :class:`TPShard` (``TP_ATTR``) that gradient
synchronisation, the replica check, gradient clipping and checkpoints read.

Why not ``torch.distributed.tensor.parallel`` (ColwiseParallel / RowwiseParallel): it runs on
gloo with this torch, but it turns the parameters into DTensors, and every tensor operation
that mixes them with plain tensors fails ("got mixed torch.Tensor and DTensor"): the seeded
initialisation (``copy_``), the bucketed gradient all-reduce (``cat``), the global-norm
clipping (``_foreach_norm``), and a raw ``all_reduce`` of a gradient has no sharding strategy;
ColwiseParallel also shards ``qkv`` contiguously (rank 0 would get all of q and half of k) —
see docs/parm.md. The two autograd functions below keep every parameter a plain tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeflow.errors import ConfigError
from moeflow.topology import Topology

# Marks a parameter that is a tensor-parallel shard (value: its TPShard).
TP_ATTR = "_moeflow_tp"


@dataclass(frozen=True)
class TPShard:
    """Where a shard sits in its global tensor: the global tensor viewed as ``view`` is split in
    ``size`` equal blocks along ``dim`` of that view, and this rank holds block ``rank``.
    The local tensor is that block, reshaped to ``local_shape``."""

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    view: tuple[int, ...]
    dim: int
    rank: int
    size: int

    @property
    def local_view(self) -> tuple[int, ...]:
        """``view`` with the split dimension cut to this rank's block."""
        v = list(self.view)
        v[self.dim] //= self.size
        return tuple(v)


def shard_of(full: torch.Tensor, spec: TPShard) -> torch.Tensor:
    """This rank's block of the global tensor ``full`` (a contiguous copy)."""
    width = spec.view[spec.dim] // spec.size
    block = full.reshape(spec.view).narrow(spec.dim, spec.rank * width, width)
    return block.contiguous().reshape(spec.local_shape)


def tp_shard(p: torch.Tensor) -> TPShard | None:
    """The TPShard of a tensor-parallel parameter, None for any other tensor."""
    return getattr(p, TP_ATTR, None)


class _CopyToMP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromMP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_mp(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    return _CopyToMP.apply(x, topo.mp_group) if topo.mp_size > 1 else x


def reduce_from_mp(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    return _ReduceFromMP.apply(x, topo.mp_group) if topo.mp_size > 1 else x


def check_divisible(owner: str, field: str, value: int, mp_size: int) -> None:
    """ConfigError naming the field unless ``value`` splits evenly over ``mp_size`` ranks."""
    if value % mp_size:
        ok = [d for d in range(1, value + 1) if value % d == 0]
        raise ConfigError(f"{owner}.{field}={value} is invalid with mp_size={mp_size}: tensor "
                          f"parallelism splits it over the MP group, so it must be a multiple "
                          f"of mp_size; change {field} or pick mp_size from {ok}")


def _sharded_weight(spec: TPShard) -> nn.Parameter:
    p = nn.Parameter(torch.empty(spec.local_shape))
    if spec.size > 1:
        setattr(p, TP_ATTR, spec)
    return p


class ColumnParallelLinear(nn.Module):
    """``y_local = f(x) @ W_local^T``: the output features of ``parts`` equal blocks (q, k, v),
    each split in ``mp_size`` and this MP rank's piece of each kept (Megatron Eq. 3, ``Y = [X
    A_1, X A_2]``). The output stays split (the caller works on its heads / hidden units)."""

    def __init__(self, in_features: int, out_features: int, topo: Topology, parts: int = 1):
        super().__init__()
        self.topo = topo
        view, dim = (((out_features, in_features), 0) if parts == 1
                     else ((parts, out_features // parts, in_features), 1))
        self.spec = TPShard((out_features, in_features),
                            (out_features // topo.mp_size, in_features), view, dim,
                            topo.mp_rank, topo.mp_size)
        self.weight = _sharded_weight(self.spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_mp(x, self.topo), self.weight)


class RowParallelLinear(nn.Module):
    """``y = g(x_local @ W_local^T)``: this MP rank's block of the input features (Megatron's
    ``B = [B_1; B_2]``); the partial outputs are summed by the all-reduce, so ``y`` is
    replicated over the MP group."""

    def __init__(self, in_features: int, out_features: int, topo: Topology):
        super().__init__()
        self.topo = topo
        self.spec = TPShard((out_features, in_features),
                            (out_features, in_features // topo.mp_size),
                            (out_features, in_features), 1, topo.mp_rank, topo.mp_size)
        self.weight = _sharded_weight(self.spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_mp(F.linear(x, self.weight), self.topo)
