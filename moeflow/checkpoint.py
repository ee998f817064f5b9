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

* dense parameters sharded by FSDP2 (``parallel.fsdp``, ``TrainConfig.dense_shard="fsdp"``)
  are DTensors ``Shard`` over the data-parallel mesh: stored whole under the same key as a
  replicated tensor (DCP writes each shard once and reads any slice back), so a checkpoint
  saved with FSDP2 loads without it and the other way round. ``qkv`` is sharded on its input
  dimension, so its ``(3, d_model, d_model)`` view is an alias of the local shard. With MP,
  FSDP2 shards each MP shard over DP on a dimension the MP split leaves whole, and the entry
  is a DTensor over the 2-D (DP, MP) dense mesh (one block per rank) of the whole weight,
  under the same key as above, so FSDP2 + MP, MP alone, FSDP2 alone and one process load
  each other's checkpoints.

AdamW's moments are stored the same way as their parameters. :func:`load` first compares the
checkpoint's entries with the model's and refuses, naming the entries, a checkpoint of another
model (missing or extra tensors, other shapes) before reading anything.

The auto-tuned exchange settings of the MoE layers (docs/autotune.md) are kept beside the tensors in
``autotune.json`` (every layer's :class:`~moeflow.autotune.TunedChoice`, measured or fixed by
``moeflow train --deterministic``), so a resume or restart on the same topology keeps them
instead of re-tuning: the timing-based choices, the pipelining degree above all, change the
summation order (docs/autotune.md, "Which choices change numerics").

A strategy that stores its experts its own way names its entries
(``ExpertStrategy.checkpoint_entries``, :mod:`moeflow.strategies.model_hooks`): the tensors
(aliases, under the keys above), the parameters they cover, every model key they may have, and
state saved beside them and restored before them (FSSDP: owned slot rows under expert
parallelism's keys, its shard maps and load windows; HECATE Section 3).

Publishing (:func:`staging_path`, :func:`publish`, :func:`find_latest`): a run's checkpoints
live under ``RUN/checkpoint/step-N``. Each is written under a temporary name
(``.step-N.partial``) and published by renaming it once every rank's part is on disk; the
``latest`` file is then replaced atomically (a temporary file and ``os.replace``). A checkpoint
cut short by a crash is therefore never mistaken for a complete one: :func:`find_latest` skips
it with a warning and returns the previous one. :func:`prune` keeps the last K published.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from moeflow.errors import ConfigError
from moeflow.experts.ffn import HIDDEN_DIM, ExpertFFN
from moeflow.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from moeflow.autotune import restore_tuning, tuning_state
from moeflow.strategies import model_hooks

OPT_KEYS = ("exp_avg", "exp_avg_sq")


def _layouts(model: nn.Module) -> dict[int, tuple]:
    """id(parameter) -> ("expert", module, hidden dim or None, ESP mesh or None, number of
    experts of the layer or None) or ("tp", TPShard, MP mesh or None, the 2-D (DP, MP) dense
    mesh or None); parameters not listed are replicated."""
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
            how[id(m.weight)] = ("tp", m.spec, mesh,
                                 m.topo.dense_mesh if m.topo.mp_size > 1 else None)
    return how


def _dtensor(local: torch.Tensor, mesh, dim: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as block ``dim`` of a global tensor of ``shape`` over the 1-D ``mesh``
    (aliases ``local``, so DCP loads into the live tensor)."""
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _dp_mp_dtensor(t: torch.Tensor, spec, dense) -> torch.Tensor:
    """An MP shard that FSDP2 shards over DP (``t``: a DTensor ``Shard(k)`` of the MP block over
    ``dense["dp"]``, :mod:`moeflow.parallel.fsdp`) as one DTensor of the whole weight in its
    ``spec.view`` over the 2-D ``dense`` mesh: ``Shard`` of the FSDP2 dimension over DP,
    ``Shard(spec.dim)`` over MP (two different dimensions, so the order of the mesh dimensions
    does not matter). Aliases the local slice, so DCP loads into the live tensor."""
    from torch.distributed.tensor import DTensor, Shard

    (place,) = t.placements
    vdim = place.dim + len(spec.view) - t.dim()    # the FSDP2 dimension in the view
    local = t.to_local()
    shape = list(spec.local_view)
    shape[vdim] = local.shape[place.dim]
    stride = torch.empty(spec.view, device="meta").stride()
    return DTensor.from_local(local.view(shape), dense, [Shard(vdim), Shard(spec.dim)],
                              run_check=False, shape=torch.Size(spec.view), stride=stride)


def _expand(prefix: str, name: str, t: torch.Tensor, how: tuple | None, out: dict) -> None:
    if how is None:
        out[f"{prefix}/{name}"] = t
    elif how[0] == "tp":
        _, spec, mesh, dense = how
        if mesh is not None and _is_dtensor(t):     # FSDP2 over DP of an MP shard
            out[f"{prefix}/{name}"] = _dp_mp_dtensor(t, spec, dense)
            return
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
    # persistent buffers (e.g. DeepSeek-V3's e_score_correction_bias), replicated on every rank
    params = {id(p) for p in model.parameters()}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in params:
            out[f"buffer/{name}"] = t
    own = set()                     # parameters a strategy stores its own way
    for entries in model_hooks.checkpoint_entries(
            model, optimizer, None if optimizer is None else lambda p: _state(optimizer, p)):
        out.update(entries.tensors)
        own |= entries.params
    for name, p in model.named_parameters():
        if id(p) in own:
            continue
        _expand("model", name, p.data, how.get(id(p)), out)
        if optimizer is None:
            continue
        state = _state(optimizer, p)
        out[f"optim/{name}/step"] = state["step"]
        for k in OPT_KEYS:
            _expand(f"optim/{k}", name, state[k], how.get(id(p)), out)
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


TUNING_FILE = "autotune.json"   # the layers' auto-tuned choices (JSON, by module)


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    state = checkpoint_state(model, optimizer, torch.tensor(step))
    state.update(_strategy_meta(model))
    with _single_process_ok():
        dcp.save(state, checkpoint_id=path)
    tuned = tuning_state(model)
    if tuned and (not dist.is_initialized() or dist.get_rank() == 0):
        (Path(path) / TUNING_FILE).write_text(json.dumps(tuned, indent=1))


_STAGERS: dict[str, object] = {}      # device type -> the process's checkpoint stager


def staging_options(device_type: str):
    """How :func:`async_save` copies the state to host memory: on CUDA into pinned buffers
    with non-blocking copies (a pageable copy would synchronise the stream for every tensor;
    the stager waits once, at the end of the staging), elsewhere plain copies. Staging stays
    synchronous (done when :func:`async_save` returns), so the next optimizer step cannot
    change a tensor being copied."""
    from torch.distributed.checkpoint.staging import StagingOptions

    cuda = device_type == "cuda"
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                          use_async_staging=False, use_non_blocking_copy=cuda)


def checkpoint_stager(device_type: str):
    """The process's stager for ``device_type`` (created once: on CUDA its pinned host buffers,
    one copy of this rank's checkpoint state, are reused by every later save)."""
    if device_type not in _STAGERS:
        from torch.distributed.checkpoint.staging import DefaultStager

        _STAGERS[device_type] = DefaultStager(staging_options(device_type))
    return _STAGERS[device_type]


def _state_device_type(model: nn.Module) -> str:
    return "cuda" if any(p.is_cuda for p in model.parameters()) else "cpu"


def async_save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
               process_group=None):
    """:func:`save` through ``dcp.async_save``: the tensors are copied to host memory (staged,
    :func:`staging_options`: pinned and non-blocking on CUDA) before this returns, the files
    are written by a background thread; returns its future. ``process_group``: a gloo group of
    its own, so that the background thread's collectives never interleave with the training's
    on the default group."""
    state = checkpoint_state(model, optimizer, torch.tensor(step))
    state.update(_strategy_meta(model))
    tuned = tuning_state(model)
    if tuned and (not dist.is_initialized() or dist.get_rank() == 0):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / TUNING_FILE).write_text(json.dumps(tuned, indent=1))
    with _single_process_ok():
        return dcp.async_save(state, checkpoint_id=path, process_group=process_group,
                              async_stager=checkpoint_stager(_state_device_type(model)))


def _model_keys(model: nn.Module) -> set[str] | None:
    """Every ``model/`` key of the model on any layout (all experts of each layer), or None
    when a layer's number of experts is unknown (experts outside a MoELayer) or the model is
    one pipeline rank's stages (``holds_part_of_model``: the others' entries are not its)."""
    if getattr(model, "holds_part_of_model", False):
        return None
    how, keys, own = _layouts(model), set(), set()
    for entries in model_hooks.checkpoint_entries(model, None, None):
        keys |= entries.keys                    # a strategy's entries, on any layout
        own |= entries.params
    for name, p in model.named_parameters():
        if id(p) in own:
            continue
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


def _strategy_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state the strategies keep beside the tensors (FSSDP: shard maps, load windows)."""
    out: dict[str, torch.Tensor] = {}
    for entries in model_hooks.checkpoint_entries(model, None, None):
        out.update(entries.meta)
    return out


def _restore_strategies(path: str, model: nn.Module, optimizer) -> None:
    """Load what the strategies saved beside the tensors and let each apply it (FSSDP may
    re-shard to the saved owners) before the tensors are loaded."""
    stored = None
    for entries in model_hooks.checkpoint_entries(model, optimizer, None):
        if not entries.meta:
            continue
        if stored is None:
            stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        meta = {k: v for k, v in entries.meta.items() if k in stored}
        if meta:
            with _single_process_ok():
                dcp.load(meta, checkpoint_id=path)
        entries.restore(meta)


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Restore model (and optimizer) in place; return the step the checkpoint was taken at."""
    _restore_strategies(path, model, optimizer)
    step = torch.tensor(0)
    state = checkpoint_state(model, optimizer, step)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key in [k for k in state if k.startswith("buffer/") and k not in saved]:
        del state[key]          # written before buffers were saved: they keep their value
    with _single_process_ok():
        _fit_to_checkpoint(path, state, _model_keys(model))
        dcp.load(state, checkpoint_id=path)
    tuning = Path(path) / TUNING_FILE            # absent in older checkpoints or without auto
    if tuning.exists():
        restore_tuning(model, json.loads(tuning.read_text()))
    return int(state["step"])


# ---- publishing: write under a temporary name, rename when complete -------------------------
STEP_DIR = re.compile(r"^step-(\d+)$")
LATEST = "latest"
COMPLETE_MARK = ".metadata"      # DCP's metadata, written by its coordinator after every rank


def staging_path(root: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is published."""
    return Path(root) / f".step-{step}.partial"


def is_complete(path: str | Path) -> bool:
    """A checkpoint folder holding DCP's metadata (the coordinator writes it last)."""
    return (Path(path) / COMPLETE_MARK).is_file()


def _replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader sees the old or the new content)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(staged: str | Path, root: str | Path, step: int) -> Path:
    """Rename the complete folder ``staged`` to ``root/step-N`` and point ``latest`` at it
    (on one rank, after every rank's part is on disk). A published folder of the same step (a
    step redone after a restart) is replaced."""
    root, staged = Path(root), Path(staged)
    if not is_complete(staged):
        raise RuntimeError(f"checkpoint {staged} is incomplete (no {COMPLETE_MARK}); "
                           "it is not published")
    final = root / f"step-{step}"
    if final.exists():
        old = root / f".step-{step}.replaced-{os.getpid()}"
        os.rename(final, old)
        shutil.rmtree(old)
    os.rename(staged, final)
    _replace_file(root / LATEST, final.name)
    return final


def published(root: str | Path) -> list[tuple[int, Path]]:
    """The complete published checkpoints under ``root`` as ``(step, path)``, oldest first."""
    root = Path(root)
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and p.is_dir() and is_complete(p):
                out.append((int(m.group(1)), p))
    return sorted(out)


def find_latest(root: str | Path) -> tuple[Path, int] | None:
    """The checkpoint to resume from: the one ``latest`` names if it is complete, else
    (with a warning) the newest complete published one before it; None when there is none.
    Unpublished folders (``.step-N.partial``, cut short by a crash) are never used."""
    root = Path(root)
    done = published(root)
    latest = root / LATEST
    named = latest.read_text().strip() if latest.is_file() else None
    partial = {}
    if root.is_dir():
        for p in root.glob(".step-*.partial"):
            m = re.match(r"^\.step-(\d+)\.partial$", p.name)
            if m:
                partial[int(m.group(1))] = p.name
    chosen = next(((p, s) for s, p in reversed(done) if p.name == named), None)
    if chosen is None:
        if named is None and not done:
            return None
        m = STEP_DIR.match(named or "")
        usable = [(s, p) for s, p in done if m is None or s < int(m.group(1))]
        chosen = (usable[-1][1], usable[-1][0]) if usable else None
        what = (f"'latest' names {named!r}, which is missing or incomplete"
                if named is not None else "no 'latest' file")
    else:
        what = None
    newer = [n for s, n in sorted(partial.items()) if chosen is None or s >= chosen[1]]
    if what or newer:
        skipped = f"skipped unpublished {', '.join(newer)} (cut short)" if newer else ""
        warnings.warn(f"checkpoints under {root}: {'; '.join(x for x in (what, skipped) if x)}"
                      f"; using {chosen[0].name if chosen else 'none'}",
                      RuntimeWarning, stacklevel=2)
    return chosen


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` published checkpoints (and stale unpublished
    folders); return the deleted paths. The one ``latest`` names is always kept."""
    root = Path(root)
    latest = root / LATEST
    named = latest.read_text().strip() if latest.is_file() else None
    done = published(root)
    doomed = [p for _, p in done[:-keep] if p.name != named] if keep < len(done) else []
    doomed += [p for p in root.glob(".step-*.partial")]
    doomed += [p for p in root.glob(".step-*.replaced-*")]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
