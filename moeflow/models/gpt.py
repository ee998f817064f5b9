"""A small GPT (pre-norm blocks, causal attention via scaled_dot_product_attention) whose FFN is
an :class:`~moeflow.layer.MoELayer` every ``moe_every`` blocks and a dense MLP elsewhere.

Every parameter is initialised from (seed, its name) only, so the model is the same function on
one rank or many. The language-model head is tied to the token embedding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.config import ModelConfig
from moeflow.init import seeded_normal
from moeflow.layer import MoELayer
from moeflow.placement.reshard import fssdp_layers, share_slots
from moeflow.topology import Topology


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, M = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.n_heads, M // self.n_heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(o.transpose(1, 2).reshape(B, S, M))


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, topo: Topology):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ffn = MoELayer(cfg.moe_config(index), topo) if cfg.is_moe(index) else DenseMLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.ffn, MoELayer):
            self.ffn.prefetch()          # HECATE FSSDP: spAG overlaps the attention (Fig. 1c)
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.ffn(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, topo: Topology | None = None):
        super().__init__()
        topo = topo or Topology.single()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i, topo) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        share_slots(fssdp_layers(self))          # HECATE Alg. 2: one slot tensor per rank
        self._init_dense()

    def _init_dense(self) -> None:
        """GPT-2 init from (seed, parameter name); residual projections scaled by 1/sqrt(2L)."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        moe_params = {id(p) for m in self.moe_layers() for p in m.parameters()}
        with torch.no_grad():
            for name, p in self.named_parameters():
                if id(p) in moe_params:
                    continue                     # the MoE layer initialises its own
                if name.endswith(".bias"):
                    p.zero_()
                elif "ln" in name.split(".")[-2]:
                    p.fill_(1.0)
                else:
                    std = resid_std if name.endswith(("proj.weight", "down.weight")) else 0.02
                    p.copy_(seeded_normal(tuple(p.shape), std, self.cfg.seed, "gpt", name))

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    @property
    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' auxiliary losses from the last forward."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """``idx: (B, S)`` byte ids -> logits ``(B, S, vocab)``, and the mean cross-entropy
        (nats per token) when ``targets`` is given."""
        B, S = idx.shape
        if S > self.cfg.seq_len:
            raise ValueError(f"sequence length {S} exceeds ModelConfig.seq_len="
                             f"{self.cfg.seq_len}; crop the input or raise seq_len")
        x = self.tok(idx) + self.pos(torch.arange(S, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.tok.weight.t()
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
