"""A pipeline stage of the GPT (:class:`GPTStage`), and this rank's stages as one module under
the GPT's parameter names (:class:`PipelineModel`).

A stage runs consecutive blocks (:mod:`moeflow.pipeline_parallel.split`); the first stage
also embeds
the byte ids, the last also applies the final norm and the head, tied to the token embedding:
the last stage holds the embedding weight under the GPT's name ``tok.weight`` too, the same
parameter where the first stage is on this rank (V schedules), else a copy whose gradient is
summed with the first stage's (:mod:`moeflow.pipeline_parallel.grads`). Every parameter is named and
initialised as in :class:`~moeflow.models.GPT` (from (seed, name)), so the stages together are
the GPT's function and a checkpoint has the GPT's keys (GPipe, Huang et al. 2019 Section 2).

The MoE layers' auxiliary loss of each stage is carried on its output
(:mod:`moeflow.pipeline_parallel.aux_carrier`); each training forward records its auxiliary loss and
the MoE layers' balancing statistic for the logs.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.config import ModelConfig
from moeflow.layer import MoELayer
from moeflow.models.gpt import Block, init_dense
from moeflow.pipeline_parallel.aux_carrier import carry_aux
from moeflow.topology import Topology


class GPTStage(nn.Module):
    def __init__(self, cfg: ModelConfig, topo: Topology, blocks: range, is_first: bool,
                 is_last: bool, aux_scale: float, tok: nn.Embedding | None = None):
        """``topo``: the stage group's topology (the MoE layers' world). ``aux_scale``: the
        weight of this stage's auxiliary loss in the step's loss (1 / micro-batches).
        ``tok``: the first stage's embedding when this last stage shares its rank."""
        super().__init__()
        self.cfg, self.is_first, self.is_last = cfg, is_first, is_last
        self.aux_scale = aux_scale
        if is_first:
            self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        elif is_last:
            self.tok = tok if tok is not None else nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i, topo) for i in blocks})
        if is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
        init_dense(self, cfg)
        self.aux_log: list[torch.Tensor] = []       # per training forward, detached
        self.balance_log: list[torch.Tensor] = []

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: byte ids ``(B, S)``; else the previous stage's activations ``(B, S,
        d_model)``. Returns the activations, on the last stage the logits."""
        if self.is_first:
            if x.shape[1] > self.cfg.seq_len:
                raise ValueError(f"sequence length {x.shape[1]} exceeds ModelConfig.seq_len="
                                 f"{self.cfg.seq_len}; crop the input or raise seq_len")
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        moe = self.moe_layers()
        if moe and self.training:
            losses = [m.aux_loss for m in moe if m.aux_loss is not None]
            aux = torch.stack(losses).sum() if losses else x.new_zeros(())
            self.aux_log.append(aux.detach().double())
            self.balance_log.append(torch.stack(
                [torch.as_tensor(m.stat_tensors["balance_loss"], device=x.device).double()
                 for m in moe]).sum())
            if torch.is_grad_enabled():
                x = carry_aux(x, aux, self.aux_scale)
        if self.is_last:
            x = self.ln_f(x) @ self.tok.weight.t()
        return x


class PipelineModel(nn.Module):
    """This rank's stages under the GPT's names (``tok``, ``pos``, ``blocks.<i>``, ``ln_f``):
    what the optimizer, the gradient synchronisation, the clipping and the checkpoints see.
    ``stages`` (not submodules, so no parameter appears twice) are in stage order."""

    # the checkpoint holds every stage's entries: this rank checks only its own against it
    # (moeflow.checkpoint; the model options are checked against the run's config.json)
    holds_part_of_model = True

    def __init__(self, stages: list[GPTStage]):
        super().__init__()
        self.blocks = nn.ModuleDict()
        for s in stages:
            if s.is_first or (s.is_last and not hasattr(self, "tok")):
                self.tok = s.tok
            if s.is_first:
                self.pos = s.pos
            if s.is_last:
                self.ln_f = s.ln_f
            self.blocks.update(s.blocks)
        self.stages = tuple(stages)

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def train(self, mode: bool = True) -> "PipelineModel":
        """Training / evaluation mode of the shared modules and of the stages themselves
        (a stage records and carries its auxiliary loss in training mode only)."""
        super().train(mode)
        for s in self.stages:
            s.train(mode)
        return self
