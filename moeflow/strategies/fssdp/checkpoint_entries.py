"""FSSDP's part of a checkpoint (HECATE Section 3: a rank stores only the experts it owns;
Algorithm 2's shard maps; Algorithm 1's load window and memory capacity ``m``).

A rank's owned experts are rows of one slot tensor
(:class:`~moeflow.strategies.fssdp.layer_experts.FSSDPExperts`); each row is split back into
its named tensors under the keys of expert parallelism (``.../experts.w1/expert/5``), written
by its owner only, so each expert is saved once with its optimizer state, and FSSDP and EP
checkpoints load into each other on any world size. Beside them: the shard maps (after
Algorithm 2's re-shards), the load windows and the budget-derived memory capacities, the same
on every rank, so that a resumed run continues exactly.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from moeflow.strategies.base import CheckpointEntries
from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
from moeflow.strategies.fssdp.reshard import apply_owners

OPT_KEYS = ("exp_avg", "exp_avg_sq")      # AdamW's moments, stored as their parameters


def _named(model: nn.Module) -> list[tuple[str, FSSDPExperts]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSSDPExperts)]


def _expand_slots(prefix: str, mname: str, m: FSSDPExperts, t: torch.Tensor, out: dict) -> None:
    """The owned rows of ``t`` (the slot tensor or its moment), as EP's per-expert keys."""
    for e, i in m.slot_index.items():
        for name, view in m._views(t[i:i + 1]).items():
            out[f"{prefix}/{mname}.{name}/expert/{e}"] = view[0]


def _meta(named: list[tuple[str, FSSDPExperts]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in named:
        out[f"fssdp/{name}/owners"] = torch.tensor(m.owners.owners, dtype=torch.int64)
        loads = m.window.state_dict()["loads"]
        win = torch.zeros(m.options.window, m.num_experts, dtype=torch.float64)
        if loads:
            win[:len(loads)] = torch.tensor(loads, dtype=torch.float64)
        out[f"fssdp/{name}/window"] = win
        out[f"fssdp/{name}/window_n"] = torch.tensor(len(loads))
        if m.budgeted:          # Algorithm 1's m agreed from the memory budgets (-1: none)
            cap = -1 if m.memory_capacity is None else m.memory_capacity
            out[f"fssdp/{name}/memory_capacity"] = torch.tensor(cap, dtype=torch.int64)
    return out


def _restore(model: nn.Module, optimizer, named: list[tuple[str, FSSDPExperts]],
             meta: dict[str, torch.Tensor]) -> None:
    """Apply the loaded windows and capacities, and re-shard to the saved owners when they fit
    this job (same world size); otherwise the experts load into the current owners."""
    if not meta:
        return                                   # an EP checkpoint: nothing to restore
    layers = dict(named)
    for name, m in layers.items():
        if f"fssdp/{name}/window" in meta:
            n = int(meta[f"fssdp/{name}/window_n"])
            m.window.load_state_dict({"w": m.options.window,
                                      "loads": meta[f"fssdp/{name}/window"][:n].tolist()})
        cap = meta.get(f"fssdp/{name}/memory_capacity")
        if cap is not None and int(cap) >= 0:   # until this job's first count exchange
            m.memory_capacity = int(cap)
    owners = [meta.get(f"fssdp/{name}/owners") for name in layers]
    shared = len({id(m.slots) for m in layers.values()}) == 1 and len(layers) > 1
    if not shared or any(o is None for o in owners):
        return
    new = [o.tolist() for o in owners]
    first = next(iter(layers.values()))
    world, rows = first.world, first.slots.shape[0]
    flat = [r for o in new for r in o]
    if max(flat) >= world or any(flat.count(r) != rows for r in range(world)):
        return                                   # another world size: keep these owners
    apply_owners(model, optimizer, new)


def fssdp_checkpoint_entries(model: nn.Module, optimizer,
                             optimizer_state: Callable | None) -> CheckpointEntries | None:
    """The FSSDP layers' experts under EP's keys (with their optimizer moments when
    ``optimizer_state`` is given), every key of them, and the shard maps / windows beside."""
    named = _named(model)
    if not named:
        return None
    entries = CheckpointEntries(meta=_meta(named))
    rows: dict[int, list] = {}                  # id(slots) -> the layers with rows in it
    for name, m in named:
        rows.setdefault(id(m.slots), []).append((name, m))
        entries.keys.update(f"model/{name}.{k}/expert/{e}" for k in m.shapes
                            for e in range(m.num_experts))
    for p in {id(m.slots): m.slots for _, m in named}.values():
        entries.params.add(id(p))
        for mname, m in rows[id(p)]:
            _expand_slots("model", mname, m, p.data, entries.tensors)
            if optimizer_state is None:
                continue
            state = optimizer_state(p)
            for k in m.shapes:              # EP's keys: one step entry per tensor name
                entries.tensors[f"optim/{mname}.{k}/step"] = state["step"]
            for k in OPT_KEYS:
                _expand_slots(f"optim/{k}", mname, m, state[k], entries.tensors)
    entries.restore = lambda meta: _restore(model, optimizer, named, meta)
    return entries


__all__ = ["fssdp_checkpoint_entries"]
