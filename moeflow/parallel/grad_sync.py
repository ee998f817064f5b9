"""Gradient synchronisation for a mix of replicated and expert-sharded parameters.

The training loss is the mean over the N ranks of each rank's local loss, and every rank calls
``backward`` on its local loss. Then:

* a replicated parameter (attention, dense FFN, router, embeddings) holds d(loss_r)/dp on rank
  r: the global gradient is the sum over the world divided by N;
* an expert parameter already received, through the backward all-to-all, the contributions of
  every rank of its expert-parallel group: d(sum_r loss_r)/dp over those ranks. Its copies on
  the other EP groups (the expert-data-parallel group) saw the remaining ranks' tokens, so the
  global gradient is the sum over the expert-data-parallel group divided by N, **not** by the
  expert-data-parallel size (the classic bug: expert gradients N/dp times too large).
  An ESP shard (Parm) is the same: the backward all-to-all brings it the contributions of every
  rank of its EP&ESP block, and its expert-data-parallel group is the ranks at the same
  position of the other blocks. With MP, the ranks of an MP group hold the same batch and
  each contributes its (equal) local loss, so dividing by N still gives the mean.
* a tensor-parallel shard (Parm's MP, ``parallel.tensor_parallel``) on MP rank m holds
  d(loss_g)/dW_m of its MP group g's loss (the f/g operators made it exact); the global loss is
  the mean over the ``dp_size`` MP groups, so the gradient is the sum over the data-parallel
  group (the ranks with MP rank m) divided by ``dp_size`` (= N / mp_size). Replicated
  parameters need nothing new: each MP rank holds the same full gradient, so the world sum
  divided by N is that mean too.
* a dense parameter sharded by FSDP2 (``parallel.fsdp``, a DTensor): FSDP2 reduce-scatters its
  gradient in backward, averaged over the data-parallel mesh. Without MP that mesh is the
  world: the same sum over the world divided by N, nothing is left to do. With MP the mesh is
  the data-parallel group: a tensor-parallel shard then has its sum over that group divided by
  ``dp_size``, as above; an MP-replicated parameter gets here what it gets without FSDP2, the
  rest of the world sum: its local slice is all-reduced over the MP group and divided by
  ``mp_size`` (the MP ranks hold the same slice of it, and can hold different partial
  gradients, e.g. the router under Parm's S1, which sees 1/N_MP of the tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moeflow.experts.ffn import EXPERT_PARAM_ATTR
from moeflow.parallel.fsdp import is_fsdp_param
from moeflow.parallel.replicas import CHECKED_ATTR, check_replicas
from moeflow.parallel.tensor_parallel import tp_shard
from moeflow.topology import Topology

_BUCKET_BYTES = 32 * 1024 * 1024


def is_expert_param(p: torch.Tensor) -> bool:
    return bool(getattr(p, EXPERT_PARAM_ATTR, False))


def sync_gradients(model: nn.Module, topo: Topology) -> None:
    """Average gradients over ranks as described in the module docstring (in place).

    Parameters without a gradient get a zero gradient first, so every rank issues the same
    collectives even when one of them did not use a parameter this step. The first call for a
    model first checks that its replicas agree (``replicas.check_replicas``, one small
    all-reduce) and raises ``ReplicaMismatchError`` if they don't: see ``prepare_model``.
    """
    if not topo.distributed:
        return
    if not getattr(model, CHECKED_ATTR, False):
        check_replicas(model, topo)
    replicated, experts, tp, fsdp_mp = [], [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if is_fsdp_param(p):        # FSDP2 reduced it over DP in backward
            if topo.mp_size > 1 and not tp_shard(p):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                fsdp_mp.append(p.grad.to_local())      # its slice, in place
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        (experts if is_expert_param(p) else tp if tp_shard(p) else replicated).append(p.grad)
    _sum_then_scale(replicated, topo.world_group, 1.0 / topo.world_size)
    _sum_then_scale(experts, topo.expert_dp_group if topo.expert_dp_size > 1 else None,
                    1.0 / topo.world_size)
    _sum_then_scale(tp, topo.dp_group if topo.dp_size > 1 else None, 1.0 / topo.dp_size)
    _sum_then_scale(fsdp_mp, topo.mp_group, 1.0 / topo.mp_size)


def _sum_then_scale(grads: list[torch.Tensor], group, scale: float) -> None:
    """All-reduce (sum) ``grads`` over ``group`` in flat buckets per dtype/device, then scale."""
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}                       # bytes in each key's last bucket
    for g in grads:
        key = (g.dtype, g.device)
        lists = buckets.setdefault(key, [[]])
        if lists[-1] and filled.get(key, 0) > _BUCKET_BYTES:
            lists.append([])
            filled[key] = 0
        lists[-1].append(g)
        filled[key] = filled.get(key, 0) + g.numel() * g.element_size()
    for lists in buckets.values():
        for bucket in lists:
            flat = _flatten_dense_tensors(bucket)
            if group is not None:
                dist.all_reduce(flat, group=group)
            flat.mul_(scale)
            for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(synced)
