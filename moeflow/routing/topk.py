"""Top-k softmax gating: k = 1 is Switch, k = 2 is GShard, any k <= E works.

Router math runs in float32 at least (float64 when the input is float64). Optional Gaussian
gate noise is added to the logits in training mode only.

``router_options={"bias": True}`` adds a learned bias to the logits, ``x W + b`` (GPT-OSS's
router; its softmax over the top-k logits equals the renormalised top-k of this softmax).
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.init import seeded_normal
from moeflow.routing.base import Router, Routing, register_router
from moeflow.routing.losses import balance_loss, z_loss


@register_router("topk")
class TopKRouter(Router):
    OPTIONS = {"bias": False}

    def __init__(self, cfg):
        super().__init__(cfg)
        self.weight = nn.Parameter(seeded_normal((cfg.d_model, cfg.num_experts), 0.02,
                                                 cfg.seed, "layer", cfg.layer_id, "router"))
        self.bias = (nn.Parameter(seeded_normal((cfg.num_experts,), 0.02, cfg.seed, "layer",
                                                cfg.layer_id, "router_bias"))
                     if cfg.router_options.get("bias") else None)

    @classmethod
    def validate_options(cls, cfg, opts: dict) -> None:
        from moeflow.errors import ConfigError

        if not isinstance(opts["bias"], bool):
            raise ConfigError(f"MoEConfig.router_options['bias']={opts['bias']!r} is invalid: "
                              "it must be True (logits x W + b, GPT-OSS) or False")

    @classmethod
    def check_top_k(cls, cfg, k: int) -> None:
        """Any k in [1, E] (checked by ``MoEConfig.per_call``)."""

    replays_choices = True

    def forward(self, x: torch.Tensor, top_k: int | None = None,
                chosen: torch.Tensor | None = None) -> Routing:
        """Route with ``cfg.top_k``, or with ``top_k`` for this call (renormalised as a layer
        built with that k would be). ``chosen``: the choices to take (a recomputation replays
        the first forward's); the gates are ``probs`` at them."""
        cfg = self.cfg
        k = cfg.top_k if top_k is None else top_k
        dt = torch.promote_types(x.dtype, torch.float32)
        logits = x.to(dt) @ self.weight.to(dt)
        if self.bias is not None:
            logits = logits + self.bias.to(dt)
        if self.training and cfg.gate_noise > 0:
            logits = logits + torch.randn_like(logits) * cfg.gate_noise
        probs = torch.softmax(logits, dim=-1)
        # the choice on detached probabilities, the gates gathered at it: the same values and
        # gradient as topk's, and the same saved tensors whether the choices are replayed or
        # not (a non-reentrant checkpoint checks that its recomputation saves what it saved)
        experts = probs.detach().topk(k, dim=-1).indices if chosen is None else chosen
        weights = probs.gather(1, experts)
        if cfg.renormalizes(k):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        lb = balance_loss(probs, experts, cfg.num_experts, cfg.balance_loss)
        zl = z_loss(logits)
        aux = cfg.aux_loss_coef * lb + cfg.z_loss_coef * zl
        return Routing(experts=experts, weights=weights, aux_loss=aux,
                       balance_loss=lb.detach(), z_loss=zl.detach())
