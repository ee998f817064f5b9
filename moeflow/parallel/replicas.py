"""Replicas start equal: broadcast them once, check them cheaply on the first gradient sync.

``sync_gradients`` averages gradients the way DDP does, but DDP also broadcasts the module's
parameters and buffers from rank 0 when it wraps a model; without that step a model whose own
layers are not seeded identically on every rank trains with replicas that never agree. Two
kinds of tensors are replicated (see ``grad_sync``):

* replicated parameters and buffers (attention, dense layers, router, embeddings): one copy per
  rank, equal over the world; the source is global rank 0;
* expert shards: different on each rank of an expert-parallel (EP) group by design, equal over
  the expert-data-parallel group (the ranks at the same EP position, which hold the same
  experts); the source is that group's first rank, global rank ``ep_rank``. With Parm's
  expert sharding (ESP) a rank's shard is replicated over the ranks at the same position of
  the other EP&ESP blocks (``topo.expert_slot``), the same rule with EP&ESP blocks for EP
  groups;
* tensor-parallel shards (Parm's MP, ``parallel.tensor_parallel``): different on each rank of
  an MP group, equal over the data-parallel group (the ranks with the same MP rank); the source
  is that group's first rank, global rank ``mp_rank``.

FSDP2's shards of the dense part (``parallel.fsdp``, DTensor parameters) differ on every rank
by design; neither function touches them (:func:`prepare_model` runs before the model is
sharded, so the shards are slices of equal weights). Tensors still on the meta device (a dense
part built without values, :mod:`moeflow.models.fsdp_build`) have nothing to broadcast: their
values come later from the seed, equal on every rank by construction.

:func:`prepare_model` broadcasts both kinds from their source. :func:`check_replicas` compares
them without moving them: one float64 checksum pair per tensor, all of them in one small
``all_reduce(MAX)`` over the world (expert checksums sit in the slot of their EP position, so
the maximum is taken over their own replica group), and raises :class:`ReplicaMismatchError`
naming the first tensor whose replicas differ. ``sync_gradients`` runs it on its first call for
each model. Only parameters are checked: buffers are broadcast by :func:`prepare_model`, but
some (running statistics) legitimately differ between ranks once training has started.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moeflow.experts.ffn import EXPERT_PARAM_ATTR
from moeflow.parallel.fsdp import is_fsdp_param
from moeflow.parallel.tensor_parallel import tp_shard
from moeflow.topology import Topology

CHECKED_ATTR = "_moeflow_replicas_checked"   # set on a model once check_replicas passed
_REL_TOL = 1e-7     # float64 checksums of equal tensors agree to ~1e-13 whatever the thread count


class ReplicaMismatchError(RuntimeError):
    """Copies of a replicated tensor differ between the ranks that should hold equal copies."""


def _is_expert(t: torch.Tensor) -> bool:
    return bool(getattr(t, EXPERT_PARAM_ATTR, False))


def _split(model: nn.Module, buffers: bool) -> tuple[list, list, list]:
    """(name, tensor) of the replicated, the expert and the tensor-parallel tensors, in module
    order. FSDP2's shards (DTensor parameters, ``parallel.fsdp``) are none of them: each rank
    holds a different slice by design, cut from weights that were equal when they were
    sharded. Meta tensors (no values yet) are left out too."""
    named = [(n, p) for n, p in model.named_parameters() if not is_fsdp_param(p)]
    if buffers:
        named += list(model.named_buffers())
    named = [(n, t) for n, t in named if not t.is_meta]
    replicated = [(n, t) for n, t in named if not _is_expert(t) and tp_shard(t) is None]
    experts = [(n, t) for n, t in named if _is_expert(t)]
    tp = [(n, t) for n, t in named if tp_shard(t) is not None]
    return replicated, experts, tp


@torch.no_grad()
def _broadcast(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast ``tensors`` in place from global rank ``src``, one flat buffer per dtype and
    device (booleans travel as bytes)."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, _), bucket in buckets.items():
        views = [t.view(torch.uint8) if dtype == torch.bool else t for t in bucket]
        flat = _flatten_dense_tensors([v.detach() for v in views])
        dist.broadcast(flat, src=src, group=group)
        for v, synced in zip(views, _unflatten_dense_tensors(flat, views)):
            v.copy_(synced)


def prepare_model(model: nn.Module, topo: Topology) -> nn.Module:
    """Make every replica equal to its source before training (DDP's initial broadcast).

    Replicated parameters and buffers are broadcast from global rank 0 over the world; expert
    shards from the first rank of their expert-data-parallel group over that group (each EP
    rank keeps its own experts). Call it once on every rank after building the model and before
    creating the optimizer (or loading a checkpoint, which is already equal on every rank).
    Returns ``model``. A world of one has nothing to do.
    """
    if not topo.distributed:
        return model
    replicated, experts, tp = _split(model, buffers=True)
    _broadcast([t for _, t in replicated], 0, topo.world_group)
    if experts and topo.expert_dp_size > 1:
        _broadcast([t for _, t in experts], topo.expert_slot, topo.expert_dp_group)
    if tp and topo.dp_size > 1:
        _broadcast([t for _, t in tp], topo.mp_rank, topo.dp_group)
    setattr(model, CHECKED_ATTR, False)        # the next sync_gradients checks again
    return model


@torch.no_grad()
def _checksums(tensors: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """Per tensor: (sum, row-position-weighted sum) in float64, and the scale sum |t|."""
    sums, scales = [], []
    for t in tensors:
        t = t.detach()
        t = t.to(torch.uint8) if t.dtype == torch.bool else t
        rows = (t.flatten(1).sum(1, dtype=torch.float64) if t.dim() >= 2
                else t.reshape(-1).to(torch.float64))
        weights = torch.linspace(1.0, 2.0, rows.numel(), dtype=torch.float64,
                                 device=rows.device)
        scale = t.abs().sum(dtype=torch.float64).to(device)
        sums += [rows.sum().to(device), (rows * weights).sum().to(device)]
        scales += [scale, scale]
    if not sums:
        return (torch.zeros(0, dtype=torch.float64, device=device),) * 2
    return torch.stack(sums), torch.stack(scales)


def check_replicas(model: nn.Module, topo: Topology) -> None:
    """Raise :class:`ReplicaMismatchError` if the replicas of any parameter differ.

    Collective (every rank must call it): one ``all_reduce`` of ``3 * 2 * (n_replicated +
    expert_slots * n_expert + mp_size * n_tensor_parallel)`` float64 values over the world.
    Marks the model as checked.
    """
    if not topo.distributed:
        return
    replicated, experts, tp = _split(model, buffers=False)
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    rep_c, rep_s = _checksums([t for _, t in replicated], device)
    exp_c, exp_s = _checksums([t for _, t in experts], device)
    tp_c, tp_s = _checksums([t for _, t in tp], device)
    n_rep, n_exp, ep = rep_c.numel(), exp_c.numel(), topo.expert_slots
    n_tp = tp_c.numel()
    length = n_rep + ep * n_exp + topo.mp_size * n_tp
    vec = torch.full((3, length), float("-inf"), dtype=torch.float64, device=device)
    off = n_rep + topo.expert_slot * n_exp      # this EP(&ESP) position's expert checksums
    off_tp = n_rep + ep * n_exp + topo.mp_rank * n_tp      # this MP rank's shard checksums
    for row, rep, exp, tps in ((0, rep_c, exp_c, tp_c), (1, -rep_c, -exp_c, -tp_c),
                               (2, rep_s, exp_s, tp_s)):
        vec[row, :n_rep] = rep
        vec[row, off:off + n_exp] = exp
        vec[row, off_tp:off_tp + n_tp] = tps
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=topo.world_group)
    hi, lo, scale = vec[0], -vec[1], vec[2]
    bad = ((hi - lo) > _REL_TOL * scale).nonzero().flatten().tolist()
    if bad:
        raise ReplicaMismatchError(_message(bad, replicated, experts, tp, n_rep, n_exp, n_tp,
                                            hi, lo, topo))
    setattr(model, CHECKED_ATTR, True)


def _message(bad: list[int], replicated, experts, tp, n_rep: int, n_exp: int, n_tp: int,
             hi, lo, topo: Topology) -> str:
    n_all_exp = topo.expert_slots * n_exp

    def name(i: int) -> str:
        if i < n_rep:
            return f"replicated parameter {replicated[i // 2][0]!r}"
        if i >= n_rep + n_all_exp:
            m, j = divmod(i - n_rep - n_all_exp, n_tp)
            return f"tensor-parallel parameter {tp[j // 2][0]!r} of MP rank {m}"
        pos, j = divmod(i - n_rep, n_exp)
        return f"expert parameter {experts[j // 2][0]!r} of expert-parallel rank {pos}"

    def where(i: int) -> str:
        if i < n_rep:
            return "equal on every rank"
        if i >= n_rep + n_all_exp:
            m = (i - n_rep - n_all_exp) // n_tp
            return (f"equal over its data-parallel group, the ranks {m}, {m + topo.mp_size}, "
                    "...")
        pos = (i - n_rep) // n_exp
        return (f"equal over its expert-data-parallel group, the ranks {pos}, "
                f"{pos + topo.expert_slots}, ...")

    names = list(dict.fromkeys(name(i) for i in bad))
    i = bad[0]
    more = f"; {len(names)} differ in all: {', '.join(names)}" if len(names) > 1 else ""
    return (f"the replicas of {name(i)} ({where(i)}) differ between ranks (checksums from {lo[i]:.6g} to "
            f"{hi[i]:.6g}){more}. sync_gradients averages gradients but cannot make unequal "
            "copies equal: call moeflow.prepare_model(model, topo) on every rank after building "
            "the model and before training (it broadcasts replicated parameters and buffers "
            "from rank 0 and expert shards within their replica group), or initialise them "
            "identically on every rank")
