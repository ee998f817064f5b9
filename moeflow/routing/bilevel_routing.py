"""SMILE's bi-level router (SMILE section 3.2.1, Eq. 3) and additive balancing loss (Eq. 4).

Experts form ``n`` groups of ``m``, group i living on node i. An inter-node router (n outputs)
picks node(s) i with probability p_i(x); an intra-node router (m outputs) picks the expert(s) j
of that node with probability q_j(x); expert ``i*m + j`` gets weight ``p_i(x) q_j(x)``. Both
routers are replicated (tied) on every rank. Cost O(max(n, m) T d) instead of O(n m T d).
Top-1 per level as in the paper; ``node_top_k`` / ``local_top_k`` give top-k per level.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.init import seeded_normal
from moeflow.routing.base import Router, Routing, register_router
from moeflow.routing.losses import balance_loss, z_loss


def additive_balance_loss(p: torch.Tensor, nodes: torch.Tensor, q: torch.Tensor,
                          locals_: torch.Tensor, alpha: float, beta: float,
                          choices: str = "all_choices") -> torch.Tensor:
    """Eq. (4): ``alpha n sum_i f_i P_i + beta m sum_j f_j Q_j``; uniform routing gives
    ``alpha + beta``. With ``choices="all_choices"`` f counts the chosen nodes / local experts
    over all ``node_top_k`` / ``local_top_k`` choices of a level; with ``"first_choice"`` only
    each token's best node / local expert (the paper's ``1{argmax p(x) = i}``). The two are the
    same at top-1 per level, the paper's setting."""
    return (alpha * balance_loss(p, nodes, p.shape[-1], choices)
            + beta * balance_loss(q, locals_, q.shape[-1], choices))


@register_router("bilevel")
class BiLevelRouter(Router):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.n = cfg.bilevel_nodes
        self.m = cfg.num_experts // self.n
        self.node_weight = nn.Parameter(seeded_normal((cfg.d_model, self.n), 0.02, cfg.seed,
                                                      "layer", cfg.layer_id, "router", "node"))
        self.local_weight = nn.Parameter(seeded_normal((cfg.d_model, self.m), 0.02, cfg.seed,
                                                       "layer", cfg.layer_id, "router", "local"))

    @classmethod
    def check_topology(cls, cfg, topo) -> None:
        """Expert group i must live on node i: expert parallelism over the whole world, and as
        many nodes as groups. A world of one (the single-process reference) holds them all."""
        from moeflow.errors import ConfigError

        if not topo.distributed:
            return
        if topo.ep_size != topo.world_size or topo.num_nodes != cfg.bilevel_nodes:
            raise ConfigError(
                f"MoEConfig.bilevel_nodes={cfg.bilevel_nodes} does not match the job: "
                f"{topo.num_nodes} node(s) x {topo.local_size} ranks with ep_size="
                f"{topo.ep_size}; set bilevel_nodes={topo.num_nodes} and keep expert "
                "parallelism over all ranks (ep_size=None)")

    def nodes_per_token(self, num_nodes: int) -> int | None:
        """The node router's ``node_top_k`` nodes per token (group i is node i:
        :meth:`check_topology`)."""
        return self.cfg.node_top_k if num_nodes == self.n else None

    @classmethod
    def check_top_k(cls, cfg, k: int) -> None:
        from moeflow.errors import ConfigError

        raise ConfigError(f"MoELayer(x, top_k={k}) is invalid: with router='bilevel' top_k is "
                          f"node_top_k x local_top_k = {cfg.node_top_k} x {cfg.local_top_k}; "
                          "build a layer with other node_top_k / local_top_k instead")

    replays_choices = True

    def forward(self, x: torch.Tensor, chosen: torch.Tensor | None = None) -> Routing:
        """``chosen``: the (node, local) pairs of a checkpoint's first forward, replayed by
        its recomputation (:mod:`moeflow.plan_record`); the gates are computed at them."""
        cfg = self.cfg
        dt = torch.promote_types(x.dtype, torch.float32)
        xd = x.to(dt)
        node_logits = xd @ self.node_weight.to(dt)
        local_logits = xd @ self.local_weight.to(dt)
        if self.training and cfg.gate_noise > 0:
            node_logits = node_logits + torch.randn_like(node_logits) * cfg.gate_noise
            local_logits = local_logits + torch.randn_like(local_logits) * cfg.gate_noise
        p, q = torch.softmax(node_logits, -1), torch.softmax(local_logits, -1)
        if chosen is None:           # chosen on detached values, gates gathered (as topk.py)
            nodes = p.detach().topk(cfg.node_top_k, dim=-1).indices          # (T, k1)
            locals_ = q.detach().topk(cfg.local_top_k, dim=-1).indices       # (T, k2)
        else:                        # choice j = node choice (j // k2), local choice (j % k2)
            k2 = cfg.local_top_k
            nodes = torch.div(chosen[:, ::k2], self.m, rounding_mode="floor")
            locals_ = torch.remainder(chosen[:, :k2], self.m)
        p_top, q_top = p.gather(1, nodes), q.gather(1, locals_)
        # every (node, local) pair; choice order: node choice major, local choice minor
        experts = (nodes.unsqueeze(2) * self.m + locals_.unsqueeze(1)).flatten(1)
        weights = (p_top.unsqueeze(2) * q_top.unsqueeze(1)).flatten(1)   # Eq. (3)
        alpha = cfg.aux_loss_coef
        beta = alpha if cfg.local_loss_coef is None else cfg.local_loss_coef
        unscaled = additive_balance_loss(p, nodes, q, locals_, 1.0, 1.0, cfg.balance_loss)
        lb = additive_balance_loss(p, nodes, q, locals_, alpha, beta, cfg.balance_loss)
        zl = z_loss(node_logits) + z_loss(local_logits)
        return Routing(experts=experts, weights=weights, aux_loss=lb + cfg.z_loss_coef * zl,
                       balance_loss=unscaled.detach(), z_loss=zl.detach())
