"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), independent of the layout.

Stacked expert weights are stored one entry per *global* expert id
(``blocks.1.ffn.experts.w1/expert/5``), so each rank writes exactly the experts it holds and
replicated tensors are written once (DCP de-duplicates equal keys). A checkpoint saved on 4
ranks loads on 2 or on 1. AdamW's moments are stored the same way.

HECATE FSSDP (``placement="fssdp"``): a rank's owned experts are rows of one slot tensor
(:class:`~moeflow.placement.layer_experts.FSSDPExperts`); each row is split back into its named
tensors under the same keys as expert parallelism (``.../experts.w1/expert/5``), written by its
owner only, so each expert is saved once with its optimizer state, and FSSDP and EP checkpoints
load into each other on any world size.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from moeflow.errors import ConfigError
from moeflow.experts.ffn import ExpertFFN
from moeflow.placement.layer_experts import FSSDPExperts

OPT_KEYS = ("exp_avg", "exp_avg_sq")


def _entries(model: nn.Module) -> list[tuple[str, nn.Parameter, int | None]]:
    """(checkpoint name, parameter, first global expert or None) for every parameter."""
    owner = {}
    for mname, m in model.named_modules():
        if isinstance(m, ExpertFFN):
            if m.shard[1] > 1:
                raise ConfigError(
                    f"checkpoint of {mname or 'the model'}: its experts are sharded over "
                    f"{m.shard[1]} ESP ranks (Parm), and checkpoints of expert shards are "
                    "not implemented yet (issue 16); train with esp_size=1 to checkpoint")
            for pname, p in m.named_parameters(recurse=False):
                owner[id(p)] = m.first_expert
    return [(n, p, owner.get(id(p))) for n, p in model.named_parameters()]


def _fssdp_rows(model: nn.Module) -> dict[int, list[tuple[str, FSSDPExperts]]]:
    """``id(slots) -> [(module name, FSSDPExperts)]``: the FSSDP layers whose owned experts
    are rows of each slot tensor (one per layer, or one for all, Algorithm 2)."""
    out: dict[int, list] = {}
    for name, m in model.named_modules():
        if isinstance(m, FSSDPExperts):
            out.setdefault(id(m.slots), []).append((name, m))
    return out


def _expand_slots(prefix: str, mname: str, m: FSSDPExperts, t: torch.Tensor, out: dict) -> None:
    """The owned rows of ``t`` (the slot tensor or its moment), as EP's per-expert keys."""
    for e, i in m.slot_index.items():
        for name, view in m._views(t[i:i + 1]).items():
            out[f"{prefix}/{mname}.{name}/expert/{e}"] = view[0]


def _expand(prefix: str, name: str, t: torch.Tensor, first: int | None, out: dict) -> None:
    if first is None:
        out[f"{prefix}/{name}"] = t
    else:
        for i in range(t.shape[0]):
            out[f"{prefix}/{name}/expert/{first + i}"] = t[i]


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     step: torch.Tensor) -> dict[str, torch.Tensor]:
    """A flat dict of tensors that *alias* the live ones (so ``dcp.load`` restores in place).

    Creates zero optimizer moments for parameters that have none yet (before the first step),
    so that a fresh optimizer can be loaded into.
    """
    out: dict[str, torch.Tensor] = {"step": step}
    fssdp = _fssdp_rows(model)
    for name, p, first in _entries(model):
        if id(p) in fssdp:
            for mname, m in fssdp[id(p)]:
                _expand_slots("model", mname, m, p.data, out)
                if optimizer is None:
                    continue
                state = _state(optimizer, p)
                for k in m.shapes:              # EP's keys: one step entry per tensor name
                    out[f"optim/{mname}.{k}/step"] = state["step"]
                for k in OPT_KEYS:
                    _expand_slots(f"optim/{k}", mname, m, state[k], out)
            continue
        _expand("model", name, p.data, first, out)
        if optimizer is None:
            continue
        state = _state(optimizer, p)
        out[f"optim/{name}/step"] = state["step"]
        for k in OPT_KEYS:
            _expand(f"optim/{k}", name, state[k], first, out)
    return out


def _state(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> dict:
    """``p``'s optimizer state, created as zeros (step 0) when it has none yet."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        for k in OPT_KEYS:
            state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


@contextmanager
def _single_process_ok():
    """DCP warns when no process group exists; a world of one is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fssdp_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """FSSDP's shard maps (after Algorithm 2's re-shards) and load windows (Algorithm 1),
    the same on every rank: restoring them makes a resumed run continue exactly."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, FSSDPExperts):
            out[f"fssdp/{name}/owners"] = torch.tensor(m.owners.owners, dtype=torch.int64)
            loads = m.window.state_dict()["loads"]
            win = torch.zeros(m.options.window, m.num_experts, dtype=torch.float64)
            if loads:
                win[:len(loads)] = torch.tensor(loads, dtype=torch.float64)
            out[f"fssdp/{name}/window"] = win
            out[f"fssdp/{name}/window_n"] = torch.tensor(len(loads))
    return out


def _restore_fssdp(path: str, model: nn.Module, optimizer) -> None:
    """Load the shard maps and windows saved with FSSDP, and re-shard to those owners when
    they fit this job (same world size); otherwise the experts load into the current owners."""
    from moeflow.placement.reshard import apply_owners, fssdp_layers

    meta = _fssdp_meta(model)
    if not meta:
        return
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    meta = {k: v for k, v in meta.items() if k in stored}
    if not meta:
        return                                   # an EP checkpoint: nothing to restore
    with _single_process_ok():
        dcp.load(meta, checkpoint_id=path)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FSSDPExperts)}
    for name, m in layers.items():
        if f"fssdp/{name}/window" in meta:
            n = int(meta[f"fssdp/{name}/window_n"])
            m.window.load_state_dict({"w": m.options.window,
                                      "loads": meta[f"fssdp/{name}/window"][:n].tolist()})
    owners = [meta.get(f"fssdp/{name}/owners") for name in layers]
    shared = len({id(m.slots) for m in layers.values()}) == 1 and len(layers) > 1
    if not shared or any(o is None for o in owners):
        return
    new = [o.tolist() for o in owners]
    world, rows = next(iter(layers.values())).world, fssdp_layers(model)[0].slots.shape[0]
    flat = [r for o in new for r in o]
    if max(flat) >= world or any(flat.count(r) != rows for r in range(world)):
        return                                   # another world size: keep these owners
    apply_owners(model, optimizer, new)


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    state = checkpoint_state(model, optimizer, torch.tensor(step))
    state.update(_fssdp_meta(model))
    with _single_process_ok():
        dcp.save(state, checkpoint_id=path)


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Restore model (and optimizer) in place; return the step the checkpoint was taken at."""
    _restore_fssdp(path, model, optimizer)
    step = torch.tensor(0)
    state = checkpoint_state(model, optimizer, step)
    with _single_process_ok():
        dcp.load(state, checkpoint_id=path)
    return int(state["step"])
