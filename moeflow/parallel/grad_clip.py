"""Global gradient-norm clipping for replicated + expert-sharded parameters.

``torch.nn.utils.clip_grad_norm_`` would see only this rank's experts, so ranks would compute
different norms and their replicated parameters would drift apart. Here the squared norm of the
expert gradients is summed over the expert-parallel group (each expert counted once) and added
to the replicated part (identical on every rank after sync_gradients). Tensor-parallel shards
(Parm's MP) are summed over the MP group, each shard counted once. FSDP2's shards of the dense
part (``parallel.fsdp``, DTensor gradients) are summed over their data-parallel mesh, each
slice counted once, and scaled in place through their local tensors; with MP, the slices of a
tensor-parallel shard are then summed over the MP group too (each slice of DP x MP once), the
slices of an MP-replicated parameter are not (equal on every MP rank after sync_gradients).

Everything stays on the device: the norms are ``foreach`` kernels, the scale is
``min(1, max_norm / (norm + 1e-6))`` applied to every gradient as a tensor (multiplying by 1 when
the norm is small, as ``clip_grad_norm_`` does), so clipping never waits for the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.experts.ffn import ESP_WHOLE_ATTR
from moeflow.parallel.fsdp import is_fsdp_param
from moeflow.parallel.grad_sync import is_expert_param
from moeflow.parallel.tensor_parallel import tp_shard
from moeflow.topology import Topology


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.nn.utils.get_total_norm(grads, 2.0).float().square()


def global_grad_norm(model: nn.Module, topo: Topology) -> torch.Tensor:
    """The L2 norm of all gradients, each expert counted once: a 0-dim float32 tensor on the
    gradients' device (no host synchronisation)."""
    rep, exp, tp, fsdp = [], [], [], {}
    for p in model.parameters():
        if p.grad is None:
            continue
        if is_fsdp_param(p):        # FSDP2: this rank's slice, by the mesh that shards it
            key = (p.grad.device_mesh, tp_shard(p) is not None)
            fsdp.setdefault(key, []).append(p.grad.to_local().detach())
        else:
            (exp if is_expert_param(p) else tp if tp_shard(p) else rep).append(p.grad.detach())
    found = rep or exp or tp or next(iter(fsdp.values()), [])
    device = found[0].device if found else torch.device("cpu")
    rep_sq, exp_sq = _squared_norm(rep, device), _squared_norm(exp, device)
    tp_sq = _squared_norm(tp, device)
    for (mesh, is_tp), local in fsdp.items():
        sq = _squared_norm(local, device)
        dist.all_reduce(sq, group=mesh.get_group())
        if is_tp:                 # an MP shard's slices: summed over MP below
            tp_sq = tp_sq + sq
        else:
            rep_sq = rep_sq + sq
    if tp or any(is_tp for _, is_tp in fsdp):    # Parm's MP: each tensor-parallel shard once
        dist.all_reduce(tp_sq, group=topo.mp_group)
        rep_sq = rep_sq + tp_sq
    if topo.esp_size > 1:         # Parm: every shard once (b2, held whole by every shard:
        exp_sq = _esp_norm(model, topo, device)     # once per ESP group)
        dist.all_reduce(exp_sq, group=topo.ep_esp_group)
    elif topo.ep_size > 1:
        dist.all_reduce(exp_sq, group=topo.ep_group)
    return (rep_sq + exp_sq).sqrt()


def _esp_norm(model: nn.Module, topo: Topology, device: torch.device) -> torch.Tensor:
    """Squared norm of this rank's expert-shard gradients, whole-expert tensors (b2, the same
    on every shard of an ESP group) divided by the ESP size so the block sum counts them once."""
    shards, whole = [], []
    for p in model.parameters():
        if p.grad is not None and is_expert_param(p):
            (whole if getattr(p, ESP_WHOLE_ATTR, False) else shards).append(p.grad.detach())
    return _squared_norm(shards, device) + _squared_norm(whole, device) / topo.esp_size


def clip_gradients(model: nn.Module, topo: Topology, max_norm: float) -> torch.Tensor:
    """Scale all gradients so their global norm is at most ``max_norm`` (0: no clipping);
    return the norm before clipping as a 0-dim tensor (read it with ``float`` when logging)."""
    norm = global_grad_norm(model, topo)
    if max_norm > 0:
        params = [p for p in model.parameters() if not is_fsdp_param(p)]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        local = [p.grad.to_local() for p in model.parameters()
                 if is_fsdp_param(p) and p.grad is not None]
        if local:                 # clip_grads_with_norm_'s scale, on FSDP2's local slices
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            with torch.no_grad():
                torch._foreach_mul_(local, coef.to(local[0].device))
    return norm
