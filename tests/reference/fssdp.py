"""FSSDP storage for one MoE layer's experts, without the layer (HECATE Section 3.2).

*Sharding phase*: each expert's parameters live on its owner only, as one flat
``nn.Parameter`` per owned expert, so ``parameters()`` — and any ``torch.optim`` optimizer built
over them — holds exactly one copy of every expert and of its optimizer state globally.

*Materialization phase*, per iteration, for a materialized placement ``P'`` (same owners):

1. :meth:`ShardedExperts.materialize` runs ``spAG(P, P')`` (Section 3.1) and returns, for every
   expert this rank holds, its named tensors: views of the owner's ``Parameter`` on the owner,
   of a received replica (a fresh leaf that requires grad) elsewhere;
2. the caller computes with them and runs backward;
3. :meth:`ShardedExperts.reduce_gradients` runs ``spRS(P', P)``: each owner's ``.grad`` becomes
   the sum, in ascending rank order, of the gradients of every copy (its own included); the
   replicas are then dropped.

A standalone building block, kept as a test reference (tests/multirank/test_fssdp.py). The MoE layer's FSSDP
(``placement="fssdp"``: slot storage, early spAG, spRS in autograd, re-materialization) is
:mod:`moeflow.strategies.fssdp.layer_experts`.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch
from torch import nn

from moeflow.comm.sparse import SparseAllGather, SparseReduceScatter
from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.placement import Placement


class ShardedExperts(nn.Module):
    """The experts of one layer, fully sharded over a process group by an owner map.

    owners: a :class:`Placement` whose ``owners`` is the shard map ``P`` (its holders ignored).
    shapes: the named tensors of one expert, e.g. ``{"w1": (d, h), "w2": (h, d)}``; an expert's
    chunk is their concatenation, flattened in this order.
    init: ``init(expert, name, shape) -> tensor``: the initial value (layout independent when it
    depends on the identity only, e.g. :func:`moeflow.init.seeded_normal`).
    """

    def __init__(self, owners: Placement, shapes: Mapping[str, tuple[int, ...]],
                 init: Callable[[int, str, tuple[int, ...]], torch.Tensor], *,
                 group=None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        import torch.distributed as dist

        if not shapes:
            raise ConfigError("ShardedExperts shapes={} is invalid: an expert needs at least "
                              "one tensor")
        self.owners = Placement.static(owners.owners, owners.world_size)
        self.group = group
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        if world != owners.world_size:
            raise ConfigError(f"ShardedExperts placement world_size={owners.world_size} does "
                              f"not match the process group's size {world}")
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.numel = sum(math.prod(s) for s in self.shapes.values())
        self.dtype, self.device = dtype, torch.device(device)
        shards = {}
        for e in self.owners.owned(self.rank):
            flat = torch.cat([init(e, name, shape).to(dtype).reshape(-1)
                              for name, shape in self.shapes.items()])
            shards[str(e)] = nn.Parameter(flat.to(self.device))
        self.shards = nn.ParameterDict(shards)
        self._held: dict[int, torch.Tensor] | None = None
        self._placement: Placement | None = None
        self.last_bytes: dict[str, tuple[int, int]] = {}

    def owned(self) -> list[int]:
        return self.owners.owned(self.rank)

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, at = {}, 0
        for name, shape in self.shapes.items():
            n = math.prod(shape)
            out[name] = flat[at:at + n].view(shape)
            at += n
        return out

    def materialize(self, placement: Placement) -> dict[int, dict[str, torch.Tensor]]:
        """spAG(P, P'): ``{expert: {name: tensor}}`` for every expert this rank holds in P'."""
        if placement.owners != self.owners.owners or \
                placement.world_size != self.owners.world_size:
            raise ConfigError("ShardedExperts.materialize: the placement's owners "
                              f"{placement.owners} differ from the shard map "
                              f"{self.owners.owners}; materialize with owners.materialize(...)")
        if self._held is not None:
            raise RuntimeError("ShardedExperts.materialize called twice: call "
                               "reduce_gradients() (or release()) for the previous placement")
        spag = SparseAllGather(self.owners.owner_chunks(), placement.holder_chunks(),
                               (self.numel,), self.dtype, group=self.group, device=self.device)
        got = spag({e: self.shards[str(e)].detach() for e in self.owned()})
        held = {}
        for e, flat in got.items():
            held[e] = (self.shards[str(e)] if self.owners.owners[e] == self.rank
                       else flat.requires_grad_(True))
        self._held, self._placement = held, placement
        self.last_bytes["spag"] = (spag.send_bytes, spag.recv_bytes)
        return {e: self._views(flat) for e, flat in held.items()}

    def reduce_gradients(self) -> None:
        """spRS(P', P): every owner's ``.grad`` = the sum of its copies' gradients; frees replicas.

        A copy with no gradient (unused this iteration) contributes zeros.
        """
        if self._held is None:
            raise RuntimeError("ShardedExperts.reduce_gradients called without a "
                               "materialized placement: call materialize() first")
        sprs = SparseReduceScatter(self._placement.holder_chunks(), self.owners.owner_chunks(),
                                   (self.numel,), self.dtype, group=self.group,
                                   device=self.device)
        grads = {e: (flat.grad if flat.grad is not None else torch.zeros_like(flat.detach()))
                 for e, flat in self._held.items()}
        out = sprs(grads)
        for e, g in out.items():
            self.shards[str(e)].grad = g
        self.last_bytes["sprs"] = (sprs.send_bytes, sprs.recv_bytes)
        self.release()

    def release(self) -> None:
        """Drop the materialized replicas (no gradient reduction)."""
        self._held, self._placement = None, None


__all__ = ["ShardedExperts"]
