"""Shared experts: FFNs every token passes through, beside its routed experts.

DeepSeekMoE / DeepSeek-V3 (section 2.1.2, Eq. 12: ``h' = u + sum_i FFN^(s)_i(u) + sum_j g_j
FFN^(r)_j(u)``) and Qwen2-MoE (``sigmoid(x W_g) * FFN^(s)(x)``). ``num_shared_experts`` FFNs of
hidden width ``shared_expert_hidden`` sum to one FFN of width ``num_shared_experts *
shared_expert_hidden`` whose hidden units are the experts' units side by side, which is how
transformers' DeepSeek-V3 holds them (``DeepseekV3MLP(moe_intermediate_size *
n_shared_experts)``); this module computes that one FFN.

The shared experts are replicated: every rank holds them whole and applies them to its own
tokens (no all-to-all), so their gradients are averaged over the data-parallel ranks like any
replicated parameter. ``MoELayer`` runs them as a computing task beside the routed experts
while the dispatch all-to-all is in flight (``moeflow/schedule/pipeline.py``).

Initial values depend only on the seed, the layer and the shared expert's index (layout
independent), like the routed experts': weights ``N(0, 1/fan_in)``, biases (with
``expert_bias``) ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, the gate ``N(0, 0.02^2)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeflow.experts.activations import build_activation
from moeflow.init import seeded_normal, seeded_uniform


class SharedExperts(nn.Module):
    """``y = [sigmoid(x w_g)] * (act(x W1 [+ b1] [, x W3 + b3]) W2 [+ b2])``, x: (T, M)."""

    def __init__(self, cfg):
        super().__init__()
        self.act = build_activation(cfg.activation, cfg.activation_options)
        n, h, M = cfg.num_shared_experts, cfg.shared_expert_hidden or cfg.d_expert, cfg.d_model
        self.num, self.hidden = n, n * h
        gated, bias = self.act.gated, cfg.expert_bias

        def weight(name: str, shape: tuple[int, ...], fan_in: int, hidden_dim: int
                   ) -> nn.Parameter:
            init = seeded_uniform if len(shape) == 1 else seeded_normal
            parts = [init(shape, 1.0 / math.sqrt(fan_in), cfg.seed, "layer", cfg.layer_id,
                          "shared", j, name) for j in range(n)]
            return nn.Parameter(torch.cat(parts, hidden_dim))

        self.w1 = weight("w1", (M, h), M, 1)
        self.w3 = weight("w3", (M, h), M, 1) if gated else None
        self.w2 = weight("w2", (h, M), h, 0)
        self.b1 = weight("b1", (h,), M, 0) if bias else None
        self.b3 = weight("b3", (h,), M, 0) if bias and gated else None
        # b2: each shared expert adds its own output bias; their sum is one bias
        self.b2 = (nn.Parameter(sum(seeded_uniform((M,), 1.0 / math.sqrt(h), cfg.seed, "layer",
                                                   cfg.layer_id, "shared", j, "b2")
                                    for j in range(n))) if bias else None)
        self.gate = (nn.Parameter(seeded_normal((M,), 0.02, cfg.seed, "layer", cfg.layer_id,
                                                "shared_gate"))
                     if cfg.shared_expert_gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype

        def affine(w, b):
            y = x @ w.to(dt)
            return y if b is None else y + b.to(dt)

        h = affine(self.w1, self.b1)
        h = self.act(h, affine(self.w3, self.b3)) if self.act.gated else self.act(h)
        y = h @ self.w2.to(dt)
        if self.b2 is not None:
            y = y + self.b2.to(dt)
        if self.gate is not None:                  # Qwen2-MoE's shared_expert_gate
            y = torch.sigmoid(x @ self.gate.to(dt)).unsqueeze(-1) * y
        return y

    def extra_repr(self) -> str:
        return (f"num={self.num}, hidden={self.hidden}, act={self.act!r}, "
                f"gate={self.gate is not None}")
