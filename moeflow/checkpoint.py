"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), independent of the layout.

Stacked expert weights are stored one entry per *global* expert id
(``blocks.1.ffn.experts.w1/expert/5``), so each rank writes exactly the experts it holds and
replicated tensors are written once (DCP de-duplicates equal keys). A checkpoint saved on 4
ranks loads on 2 or on 1. AdamW's moments are stored the same way.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from moeflow.errors import ConfigError
from moeflow.experts.ffn import ExpertFFN

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
    # persistent buffers (e.g. DeepSeek-V3's e_score_correction_bias), replicated on every rank
    params = {id(p) for p in model.parameters()}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in params:
            out[f"buffer/{name}"] = t
    for name, p, first in _entries(model):
        _expand("model", name, p.data, first, out)
        if optimizer is None:
            continue
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for k in OPT_KEYS:
                state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out[f"optim/{name}/step"] = state["step"]
        for k in OPT_KEYS:
            _expand(f"optim/{k}", name, state[k], first, out)
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


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Restore model (and optimizer) in place; return the step the checkpoint was taken at."""
    step = torch.tensor(0)
    state = checkpoint_state(model, optimizer, step)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key in [k for k in state if k.startswith("buffer/") and k not in saved]:
        del state[key]          # written before buffers were saved: they keep their value
    with _single_process_ok():
        dcp.load(state, checkpoint_id=path)
    return int(state["step"])
