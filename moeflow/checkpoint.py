"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), independent of the layout.

Every tensor is stored under its *global* identity, so a checkpoint saved on one layout loads
on any other (more or fewer ranks, other EP / MP / ESP sizes), optimizer state included:

* replicated tensors whole (``model/tok.weight``); every rank offers them and DCP writes one
  copy (it de-duplicates equal keys);
* stacked expert weights one entry per *global* expert id
  (``model/blocks.1.ffn.experts.w1/expert/5``), so each rank writes exactly the experts it
  holds. With Parm's expert sharding (ESP) a rank holds a slice of an expert's hidden
  dimension: its entry is a DTensor ``Shard(hidden dim)`` over the ESP mesh
  (``topo.mesh["esp"]``), and DCP stores the whole expert from the shards and reads any slice
  of it back;
* tensor-parallel weights (Parm's MP, ``parallel.tensor_parallel``) whole, as a DTensor
  ``Shard`` over the MP mesh (``topo.dense_mesh["mp"]``). The column-parallel ``qkv`` weight is
  stored in its global ``(3, d_model, d_model)`` view (q, k, v blocks; an MP rank holds the same
  rows of each), so that an MP rank's piece is one block of it; checkpoints written before
  tensor parallelism stored it as ``(3 * d_model, d_model)`` and load into one process as such.

AdamW's moments are stored the same way as their parameters. :func:`load` first compares the
checkpoint's entries with the model's and refuses, naming the entries, a checkpoint of another
model (missing or extra tensors, other shapes) before reading anything.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from moeflow.errors import ConfigError
from moeflow.experts.ffn import HIDDEN_DIM, ExpertFFN
from moeflow.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

OPT_KEYS = ("exp_avg", "exp_avg_sq")


def _layouts(model: nn.Module) -> dict[int, tuple]:
    """id(parameter) -> ("expert", module, hidden dim or None, ESP mesh or None, number of
    experts of the layer or None) or ("tp", TPShard, MP mesh or None); parameters not listed
    are replicated."""
    from moeflow.layer import MoELayer

    how: dict[int, tuple] = {}
    for mname, m in model.named_modules():
        if isinstance(m, MoELayer):
            if m.topo.esp_size > 1 and m.topo.mesh is None:
                raise ConfigError(f"checkpoint of {mname}: its experts are ESP shards (1 of "
                                  f"{m.topo.esp_size}) and need the topology's ESP mesh (a "
                                  "topology from Topology.from_env)")
            mesh = m.topo.mesh["esp"] if m.topo.esp_size > 1 else None
            for pname, p in m.experts.named_parameters(recurse=False):
                how[id(p)] = ("expert", m.experts, HIDDEN_DIM.get(pname), mesh,
                              m.cfg.num_experts)
        elif isinstance(m, ExpertFFN) and id(m.w1) not in how:
            if m.shard[1] > 1:
                raise ConfigError(
                    f"checkpoint of {mname or 'the model'}: its experts are ESP shards (1 of "
                    f"{m.shard[1]}) outside a MoELayer, so the ESP mesh that stores them whole "
                    "is unknown; checkpoint the MoELayer (or model) that holds them")
            for pname, p in m.named_parameters(recurse=False):
                how[id(p)] = ("expert", m, None, None, None)
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            mesh = m.topo.dense_mesh["mp"] if m.topo.mp_size > 1 else None
            if m.spec.size > 1 and mesh is None:
                raise ConfigError(f"checkpoint of {mname}: a tensor-parallel shard (1 of "
                                  f"{m.spec.size}) needs its topology's MP mesh (a topology "
                                  "from Topology.from_env)")
            how[id(m.weight)] = ("tp", m.spec, mesh)
    return how


def _dtensor(local: torch.Tensor, mesh, dim: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as block ``dim`` of a global tensor of ``shape`` over the 1-D ``mesh``
    (aliases ``local``, so DCP loads into the live tensor)."""
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def _expand(prefix: str, name: str, t: torch.Tensor, how: tuple | None, out: dict) -> None:
    if how is None:
        out[f"{prefix}/{name}"] = t
    elif how[0] == "tp":
        _, spec, mesh = how
        local = t.view(spec.local_view)
        out[f"{prefix}/{name}"] = (local if mesh is None
                                   else _dtensor(local, mesh, spec.dim, spec.view))
    else:
        _, m, dim, mesh, _ = how
        for i in range(t.shape[0]):
            key = f"{prefix}/{name}/expert/{m.first_expert + i}"
            if mesh is None or dim is None:      # whole experts, or b2 (held whole by shards)
                out[key] = t[i]
            else:
                shape = list(t[i].shape)
                shape[dim] *= m.shard[1]
                out[key] = _dtensor(t[i], mesh, dim, tuple(shape))


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     step: torch.Tensor) -> dict[str, torch.Tensor]:
    """A flat dict of tensors that *alias* the live ones (so ``dcp.load`` restores in place).

    Creates zero optimizer moments for parameters that have none yet (before the first step),
    so that a fresh optimizer can be loaded into.
    """
    how = _layouts(model)
    out: dict[str, torch.Tensor] = {"step": step}
    for name, p in model.named_parameters():
        _expand("model", name, p.data, how.get(id(p)), out)
        if optimizer is None:
            continue
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for k in OPT_KEYS:
                state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out[f"optim/{name}/step"] = state["step"]
        for k in OPT_KEYS:
            _expand(f"optim/{k}", name, state[k], how.get(id(p)), out)
    return out


@contextmanager
def _single_process_ok():
    """DCP warns when no process group exists; a world of one is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    with _single_process_ok():
        dcp.save(checkpoint_state(model, optimizer, torch.tensor(step)), checkpoint_id=path)


def _model_keys(model: nn.Module) -> set[str] | None:
    """Every ``model/`` key of the model on any layout (all experts of each layer), or None
    when a layer's number of experts is unknown (experts outside a MoELayer)."""
    how, keys = _layouts(model), set()
    for name, p in model.named_parameters():
        h = how.get(id(p))
        if h is None or h[0] == "tp":
            keys.add(f"model/{name}")
        elif h[4] is None:
            return None
        else:
            keys.update(f"model/{name}/expert/{e}" for e in range(h[4]))
    return keys


def _fit_to_checkpoint(path: str, state: dict[str, torch.Tensor],
                       model_keys: set[str] | None) -> None:
    """Compare the checkpoint's entries with ``state``; raise ConfigError naming what differs
    (another model). A whole tensor saved in another shape of the same size (the 2-D ``qkv``
    of older checkpoints) is read through a view of that shape."""
    from torch.distributed.tensor import DTensor

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = [k for k in state if k not in saved]
    extra = ([k for k in saved if k.startswith("model/") and k not in model_keys]
             if model_keys is not None else [])
    shapes = []
    for key, value in state.items():
        size = getattr(saved.get(key), "size", None)
        if size is None or tuple(size) == tuple(value.shape):
            continue
        if not isinstance(value, DTensor) and value.numel() == size.numel():
            state[key] = value.view(size)
        else:
            shapes.append(f"{key}: {tuple(size)} saved, {tuple(value.shape)} here")
    if not (missing or extra or shapes):
        return
    parts = [f"{len(v)} {what} (e.g. {', '.join(v[:3])})"
             for what, v in (("tensors of this model are not in it", missing),
                              ("tensors in it are not in this model", extra),
                              ("tensors have another shape", shapes)) if v]
    raise ConfigError(
        f"checkpoint {path} was saved from another model: {'; '.join(parts)}. A checkpoint "
        "loads on any layout (ranks, --ep-size, --mp, --esp) but only into the model it was "
        "saved from: use the model options of its run (config.json beside it)")


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Restore model (and optimizer) in place; return the step the checkpoint was taken at."""
    step = torch.tensor(0)
    state = checkpoint_state(model, optimizer, step)
    with _single_process_ok():
        _fit_to_checkpoint(path, state, _model_keys(model))
        dcp.load(state, checkpoint_id=path)
    return int(state["step"])
