"""Heterogeneous sharding, HECATE Algorithm 2 (Section 4.3), and the re-sharding that applies it.

**One slot tensor per rank for all FSSDP layers** (:func:`share_slots`): Algorithm 2 keeps the
number of expert slots per device equal over *all* MoE layers together (line 3: ``S =
|E^g| / |D|``), while a layer may give a device any number of its experts. The owned experts of
every layer are therefore rows of one ``nn.Parameter`` per rank of ``S`` rows, whose shape never
changes, so a standard ``torch.optim`` optimizer built once over ``model.parameters()`` keeps
working after a re-shard: :func:`reshard` moves the rows of the parameter **and of every
optimizer-state tensor of its shape** (AdamW's moments) to their new owners.

**Algorithm 2** (:func:`heterogeneous_sharding`), line by line:

1-2. ``J`` = the top-``t`` experts by load of each layer (the overlappable ones Algorithm 1
     replicates), ``J'`` = the rest;
3.   ``S_d = |E^g| / |D|`` free slots per device;
6-14. the layers' ``J'`` sets in descending order of their largest load; in each, experts by
     descending load: the least-loaded node (the layer's load placed on it so far), ties to the
     node with fewer free slots; on it the least-loaded device, ties to fewer free slots
     (then lower ids); the expert goes there and the device loses a slot;
16.  the ``J`` experts fill the remaining slots (the paper: "arbitrarily"; here in layer and
     expert order, each to the device with the most free slots, then the lowest id).

Every rank runs it on the same inputs (the layers' load windows, filled from the count
exchange), so every rank computes the same plan; the rows then move by batched point-to-point
(bounded by the group's timeout).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moeflow.comm.sparse import group_timeout, wait_work
from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
from moeflow.strategies.fssdp.placement import Placement


def fssdp_layers(model: nn.Module) -> list[FSSDPExperts]:
    return [m for m in model.modules() if isinstance(m, FSSDPExperts)]


def share_slots(layers: list[FSSDPExperts]) -> None:
    """Put every layer's owned rows into one slot tensor per rank (layer order, then expert
    order); each layer keeps a view of its rows by index. Layers must share expert size,
    dtype and device (the GPT's MoE layers do)."""
    if len(layers) < 2:
        return
    first = layers[0]
    for m in layers[1:]:
        if (m.numel, m.shapes, m.world, m.rank) != (first.numel, first.shapes, first.world,
                                                    first.rank):
            raise ConfigError("placement='fssdp' across layers needs equal experts in every "
                              "MoE layer (the same d_model, d_expert, activation, "
                              "expert_bias): Algorithm 2's slots hold any layer's expert")
    rows, at, index = [], 0, []
    for m in layers:
        rows.append(m.slots.detach())
        index.append({e: at + i for e, i in m.slot_index.items()})
        at += m.slots.shape[0]
    shared = nn.Parameter(torch.cat(rows))
    from moeflow.experts.ffn import EXPERT_PARAM_ATTR

    setattr(shared, EXPERT_PARAM_ATTR, True)
    from moeflow.strategies.fssdp.optimizers import mark_slots

    mark_slots(shared)                  # refuse optimizers that are not elementwise
    for m, idx in zip(layers, index):
        m.set_owners(m.owners, shared, idx)


def heterogeneous_sharding(loads: list[np.ndarray], t, world: int, local_size: int
                           ) -> list[list[int]]:
    """Algorithm 2: ``loads[l][e]`` (layer ``l``'s estimated load of expert ``e``), ``t`` the
    overlap degree (an int, or one per layer) -> ``owners[l][e]``. Every device ends with
    ``sum_l |E_l| / world`` experts."""
    L = len(loads)
    ts = [int(t)] * L if np.isscalar(t) else [int(x) for x in t]
    sizes = [len(x) for x in loads]
    total = sum(sizes)
    if total % world:
        raise ConfigError(f"heterogeneous sharding: {total} experts over {world} ranks leave "
                          "unequal slots; use a multiple of the world size")
    if world % local_size:
        raise ConfigError(f"heterogeneous sharding: local_size={local_size} must divide "
                          f"{world}")
    loads = [np.asarray(x, dtype=np.float64) for x in loads]
    top = [set(sorted(range(sizes[l]), key=lambda e: (-loads[l][e], e))[:min(ts[l], sizes[l])])
           for l in range(L)]                                                # line 1 (J)
    rest = [[e for e in range(sizes[l]) if e not in top[l]] for l in range(L)]   # line 2
    free = np.full(world, total // world, dtype=np.int64)                    # line 3
    owners = [[-1] * sizes[l] for l in range(L)]
    nodes = world // local_size
    order = sorted(range(L), key=lambda l: (-max((loads[l][e] for e in rest[l]), default=-1),
                                            l))
    for l in order:                                                          # line 7
        placed = np.zeros(world)                 # this layer's load on each device so far
        for e in sorted(rest[l], key=lambda e: (-loads[l][e], e)):            # line 9
            cand = [n for n in range(nodes)
                    if free[n * local_size:(n + 1) * local_size].sum() > 0]
            node = min(cand, key=lambda n: (placed[n * local_size:(n + 1) * local_size].sum(),
                                            free[n * local_size:(n + 1) * local_size].sum(),
                                            n))                               # line 10
            devs = [d for d in range(node * local_size, (node + 1) * local_size) if free[d]]
            d = min(devs, key=lambda d: (placed[d], free[d], d))              # line 11
            owners[l][e] = d                                                  # line 12
            free[d] -= 1                                                      # line 13
            placed[d] += loads[l][e]
    for l in range(L):                                                       # line 16
        for e in sorted(top[l]):
            d = int(np.argmax(free))             # the most free slots, then the lowest id
            owners[l][e] = d
            free[d] -= 1
    return owners


def _rows_layout(owners: list[list[int]], rank: int) -> list[dict[int, int]]:
    """Rows of ``rank``'s slot tensor: its owned (layer, expert) pairs in layer, expert order."""
    out, at = [], 0
    for layer in owners:
        idx = {}
        for e, r in enumerate(layer):
            if r == rank:
                idx[e] = at
                at += 1
        out.append(idx)
    return out


@torch.no_grad()
def _move_rows(tensors: list[torch.Tensor], old: list[list[int]], new: list[list[int]],
               rank: int, world: int, group) -> list[torch.Tensor]:
    """New row layouts of ``tensors`` (each ``(S, ...)``, this rank's slot rows under ``old``)
    under ``new``: staying rows are copied, the others travel by batched p2p."""
    old_rows = [_rows_layout(old, r) for r in range(world)]
    new_rows = _rows_layout(new, rank)
    mine_old = old_rows[rank]
    outs = [torch.empty_like(t) for t in tensors]
    sends, recvs = [], []
    for l, layer in enumerate(new):
        for e, dst in enumerate(layer):
            src = old[l][e]
            if src == rank and dst == rank:
                for t, o in zip(tensors, outs):
                    o[new_rows[l][e]].copy_(t[mine_old[l][e]])
            elif src == rank:
                sends += [(dst, t[mine_old[l][e]].contiguous(), l, e, k)
                          for k, t in enumerate(tensors)]
            elif dst == rank:
                recvs += [(src, o[new_rows[l][e]], l, e, k) for k, o in enumerate(outs)]
    if world > 1 and (sends or recvs):
        def tag(l, e, k):          # unique per (layer, expert, tensor): matches send to recv
            return (sum(len(x) for x in new[:l]) + e) * len(tensors) + k
        ops = [dist.P2POp(dist.isend, buf, group=group, group_peer=peer, tag=tag(l, e, k))
               for peer, buf, l, e, k in sends]
        bufs = [(torch.empty_like(view), view) for _, view, *_ in recvs]
        ops += [dist.P2POp(dist.irecv, buf, group=group, group_peer=peer, tag=tag(l, e, k))
                for (peer, _, l, e, k), (buf, _) in zip(recvs, bufs)]
        timeout = group_timeout(group)
        device = tensors[0].device      # a stream wait on CUDA, a bounded host wait on gloo
        for work in dist.batch_isend_irecv(ops):
            wait_work(work, timeout, device)
        for buf, view in bufs:
            view.copy_(buf)
    return outs


def reshard(model: nn.Module, optimizer: torch.optim.Optimizer | None, t=None) -> list:
    """Algorithm 2 over the model's FSSDP layers, then move the slot rows of the parameter and
    of its optimizer state (every state tensor of the parameter's shape) to the new owners.
    ``t``: the overlap degree (default: each layer's Algorithm 1 ``t``, 0 without one).
    Collective over the FSSDP group; returns the new owners per layer."""
    layers = fssdp_layers(model)
    if not layers:
        return []
    slots = layers[0].slots
    if any(m.slots is not slots for m in layers):
        raise ConfigError("reshard needs the FSSDP layers to share one slot tensor "
                          "(moeflow.strategies.fssdp.reshard.share_slots; the GPT does it)")
    loads = []
    for m in layers:
        est = m.window.estimate()
        loads.append(est if est is not None else np.zeros(m.num_experts))
    if t is None:
        t = [m.overlap() if m.options.materialize == "sparse" else 0 for m in layers]
    first = layers[0]
    new = heterogeneous_sharding(loads, t, first.world, first.local_size)
    apply_owners(model, optimizer, new)
    return new


def apply_owners(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 new: list[list[int]]) -> None:
    """Move the shared slot rows (parameter and optimizer state) to the owners ``new[l][e]``
    and give every FSSDP layer its new shard map. Collective."""
    layers = fssdp_layers(model)
    slots, first = layers[0].slots, layers[0]
    old = [list(m.owners.owners) for m in layers]
    if new == old:
        return
    counts = np.bincount(np.concatenate([np.asarray(x) for x in new]), minlength=first.world)
    if len(counts) != first.world or (counts != slots.shape[0]).any():
        raise ConfigError(f"FSSDP owners {new} give ranks {counts.tolist()} experts; each "
                          f"rank has {slots.shape[0]} slots (Algorithm 2's constraint)")
    state = optimizer.state.get(slots, {}) if optimizer is not None else {}
    keys = [k for k, v in state.items() if torch.is_tensor(v) and v.shape == slots.shape]
    moved = _move_rows([slots.detach()] + [state[k] for k in keys], old, new, first.rank,
                       first.world, first.group)
    with torch.no_grad():
        slots.copy_(moved[0])
        for k, v in zip(keys, moved[1:]):
            state[k].copy_(v)
    rows = _rows_layout(new, first.rank)
    for m, owners, idx in zip(layers, new, rows):
        m.set_owners(Placement.static(owners, first.world), slots, idx)


def due(model: nn.Module, step: int, option: str) -> bool:
    """True when optimizer step ``step`` is a multiple of the first FSSDP layer's
    ``fssdp.<option>`` (an interval in steps; 0 = never, as without FSSDP layers)."""
    layers = fssdp_layers(model)
    every = getattr(layers[0].options, option) if layers else 0
    return bool(every) and step % every == 0


def maybe_reshard(model: nn.Module, optimizer, step: int) -> bool:
    """Re-shard every ``fssdp.reshard_every`` steps (the first layer's option; 0 = never)."""
    if not due(model, step, "reshard_every"):
        return False
    reshard(model, optimizer)
    return True


__all__ = ["apply_owners", "fssdp_layers", "heterogeneous_sharding", "maybe_reshard", "reshard",
           "share_slots"]
