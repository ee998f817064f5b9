"""A small GPT (pre-norm blocks, causal attention via scaled_dot_product_attention) whose FFN is
an :class:`~moeflow.layer.MoELayer` every ``moe_every`` blocks and a dense MLP elsewhere.

Every parameter is initialised from (seed, its name) only, so the model is the same function on
one rank or many. The language-model head is tied to the token embedding.

With ``topo.mp_size > 1`` (Parm's MP) attention and the dense MLP are Megatron tensor parallel
over ``topo.mp_group`` (:mod:`moeflow.parallel.tensor_parallel`): ``qkv`` and ``up`` are
column parallel (an MP rank keeps ``n_heads / mp_size`` heads and ``d_ff / mp_size`` hidden
units), ``proj`` and ``down`` row parallel, so every block's output, hence every MoE layer's
input, is replicated over the MP group, as Parm assumes (Section II-B). A shard is initialised
as the slice of the global weight drawn from (seed, name). Embeddings, layer norms and the tied
head stay replicated.

With ``meta_dense=True`` the GPT's own dense modules (embeddings, layer norms, attention, dense
MLPs, final norm) are built on the meta device, without values, and the MoE layers as usual:
FSDP2 then shards the dense part and each rank fills only its local shards from
:meth:`GPT.initial_value`, one parameter at a time (:mod:`moeflow.models.fsdp_build`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moeflow.config import ModelConfig
from moeflow.init import seeded_normal
from moeflow.layer import MoELayer
from moeflow.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                              check_divisible, shard_of, tp_shard)
from moeflow.strategies import model_hooks
from moeflow.topology import Topology


class Attention(nn.Module):
    """Causal self-attention; with MP, this rank's ``n_heads / mp_size`` heads (Megatron)."""

    def __init__(self, cfg: ModelConfig, topo: Topology):
        super().__init__()
        self.n_heads, self.dropout = cfg.n_heads // topo.mp_size, cfg.dropout
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = ColumnParallelLinear(cfg.d_model, 3 * cfg.d_model, topo, parts=3)
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, topo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.n_heads, self.head_dim).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(o.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))


class DenseMLP(nn.Module):
    """``down(gelu(up(x)))``; with MP, this rank's ``d_ff / mp_size`` hidden units."""

    def __init__(self, cfg: ModelConfig, topo: Topology):
        super().__init__()
        self.up = ColumnParallelLinear(cfg.d_model, cfg.d_ff, topo)
        self.down = RowParallelLinear(cfg.d_ff, cfg.d_model, topo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _dense_device(meta: bool):
    """The meta device as the default for the dense modules built inside (``meta_dense``)."""
    return torch.device("meta") if meta else contextlib.nullcontext()


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, topo: Topology, meta_dense: bool = False):
        super().__init__()
        with _dense_device(meta_dense):
            self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
            self.attn = Attention(cfg, topo)
        if cfg.is_moe(index):
            self.ffn = MoELayer(cfg.moe_config(index), topo)
        else:
            with _dense_device(meta_dense):
                self.ffn = DenseMLP(cfg, topo)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, regather: MoELayer | None = None) -> torch.Tensor:
        """``regather``: the previous block's MoE layer, whose backward comes right after this
        block's attention backward: with ``fssdp.overlap_regather`` its HECATE-RM spAG starts
        when this attention's backward does (HECATE Section 3.2)."""
        if isinstance(self.ffn, MoELayer):
            self.ffn.prefetch()          # HECATE FSSDP: spAG overlaps the attention (Fig. 1c)
        a = self.attn(self.ln1(x))
        if regather is not None:
            regather.regather_on_grad(a)
        x = x + self.drop(a)
        return x + self.drop(self.ffn(self.ln2(x)))


def dense_initial_value(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole (unsharded) initial value of the GPT's own dense parameter ``name`` (its name in
    :class:`GPT`) of global ``shape``, float32 on CPU: GPT-2 init from (seed, name), residual
    projections scaled by 1/sqrt(2L); biases 0, layer-norm weights 1."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "ln" in name.split(".")[-2]:
        return torch.ones(shape)
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    std = resid_std if name.endswith(("proj.weight", "down.weight")) else 0.02
    return seeded_normal(shape, std, cfg.seed, "gpt", name)


def init_dense(module: nn.Module, cfg: ModelConfig) -> None:
    """Every dense parameter of ``module`` outside its MoE layers from
    :func:`dense_initial_value` of its name (a :class:`GPT`, or a pipeline stage holding the
    GPT's modules under the GPT's names); a tensor-parallel shard gets its slice of the global
    weight. Parameters on the meta device (``meta_dense``) are left to
    :mod:`moeflow.models.fsdp_build`."""
    moe_params = {id(p) for m in module.modules() if isinstance(m, MoELayer)
                  for p in m.parameters()}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if id(p) in moe_params or p.is_meta:
                continue                     # the MoE layer initialises its own
            spec = tp_shard(p)
            w = dense_initial_value(cfg, name, spec.global_shape if spec else tuple(p.shape))
            p.copy_(shard_of(w, spec) if spec else w)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, topo: Topology | None = None, meta_dense: bool = False):
        """``meta_dense``: build the embeddings, layer norms, attention and dense MLPs on the
        meta device, uninitialised (module docstring); the MoE layers are built as usual."""
        super().__init__()
        topo = topo or Topology.single()
        check_divisible("ModelConfig", "n_heads", cfg.n_heads, topo.mp_size)
        if cfg.num_moe_layers < cfg.n_layers:
            check_divisible("ModelConfig", "d_ff", cfg.d_ff, topo.mp_size)
        self.cfg = cfg
        with _dense_device(meta_dense):
            self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i, topo, meta_dense) for i in range(cfg.n_layers))
        with _dense_device(meta_dense):
            self.ln_f = nn.LayerNorm(cfg.d_model)
        # activation recomputation (TrainConfig.recompute="full"): every block's forward runs
        # under non-reentrant torch.utils.checkpoint and again in backward
        self.checkpoint_blocks = False
        model_hooks.setup_model(self)            # e.g. FSSDP's one slot tensor (HECATE Alg. 2)
        self._init_dense()

    def initial_value(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole (unsharded) initial value of the GPT's own dense parameter ``name`` of
        global ``shape`` (:func:`dense_initial_value`)."""
        return dense_initial_value(self.cfg, name, shape)

    def _init_dense(self) -> None:
        init_dense(self, self.cfg)

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
        recompute = self.checkpoint_blocks and torch.is_grad_enabled()
        if recompute:
            self._refuse_block_recompute()
        prev = None                      # the last block's MoE layer (overlap_regather)
        for block in self.blocks:
            if recompute:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, regather=prev)
            prev = block.ffn if isinstance(block.ffn, MoELayer) else None
        logits = self.ln_f(x) @ self.tok.weight.t()
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                            targets.reshape(-1))
        if prev is not None:             # the last block's re-gather: at the backward's start
            prev.regather_on_grad(logits if loss is None else loss)
        return logits, loss

    def _refuse_block_recompute(self) -> None:
        model_hooks.refuse_block_recompute(
            enumerate(m.cfg for m in self.moe_layers()),
            "activation recomputation (GPT.checkpoint_blocks, --recompute full)",
            setting_first=True)
