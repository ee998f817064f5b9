"""DeepSeek-V3 routing: sigmoid affinities, group-limited top-k, and auxiliary-loss-free load
balancing through a score-correction bias (DeepSeek-V3 technical report, section 2.1.2).

Per token t and expert i (``MoEConfig.router="deepseek_v3"``, settings in ``router_options``):

* ``s_i = sigmoid(u_t . e_i)``: affinities (Eq. 15, in float32 at least).
* Selection reads ``s_i + b_i``, with ``b`` the bias buffer ``e_score_correction_bias``; the
  gate weights come from the unbiased ``s_i`` (Eq. 16 with the bias of section 2.1.2).
* Group-limited (node-limited) routing: the experts form ``n_group`` equal groups; a group's
  score is the sum of its two highest biased affinities, and only the ``topk_group`` best
  groups are eligible (ineligible scores become -inf, as in DeepSeek-V3's inference code and
  transformers' ``DeepseekV3TopkRouter``: with a negative bias an eligible expert's biased
  score can be below 0, and it must still win over every ineligible one).
  With one group per node this bounds how many nodes a token's copies reach, the property
  SMILE's bi-level routing gets from its node router (``routing/bilevel_routing.py``).
* ``g_i = s_i / sum_{j in top-k} s_j`` when renormalising (``MoEConfig.renormalize``, default
  True here, transformers' ``norm_topk_prob``), times ``routed_scaling_factor``.
* Auxiliary-loss-free balancing: after each optimizer step,
  ``b_i <- b_i + gamma * sign(mean_j load_j - load_i)``, with the loads (tokens routed to each
  expert, all top-k choices) summed over every rank since the last update, so every rank keeps
  the same bias (:func:`update_router_biases`). ``gamma`` is ``bias_update_speed`` (0: off).
  The bias is a buffer: checkpoints save it; no gradient reaches it.

The balancing loss (``aux_loss_coef``, DeepSeek-V3's complementary sequence-wise loss, Eq.
17-20, taken over the local batch) uses the normalised affinities ``s_i / sum_j s_j`` as P;
set ``aux_loss_coef=0`` for purely auxiliary-loss-free training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.init import seeded_normal
from moeflow.routing.base import Router, Routing, register_router
from moeflow.routing.losses import balance_loss, z_loss


@register_router("deepseek_v3")
class DeepSeekV3Router(Router):
    OPTIONS = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
               "bias_update_speed": 0.001}

    def __init__(self, cfg):
        super().__init__(cfg)
        self.opts = cfg.router_options
        self.weight = nn.Parameter(seeded_normal((cfg.d_model, cfg.num_experts), 0.02,
                                                 cfg.seed, "layer", cfg.layer_id, "router"))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        # tokens routed to each expert since the last bias update (not saved: per step)
        self.register_buffer("load", torch.zeros(cfg.num_experts), persistent=False)

    @classmethod
    def validate_options(cls, cfg, opts: dict) -> None:
        from moeflow.errors import ConfigError

        g, tg = opts["n_group"], opts["topk_group"]
        for name in ("n_group", "topk_group"):
            v = opts[name]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"MoEConfig.router_options['{name}']={v!r} is invalid: it "
                                  "must be a positive integer")
        if cfg.num_experts % g:
            raise ConfigError(f"MoEConfig.router_options['n_group']={g} is invalid for "
                              f"num_experts={cfg.num_experts}: the experts form n_group equal "
                              "groups; pick a divisor of num_experts")
        if tg > g:
            raise ConfigError(f"MoEConfig.router_options['topk_group']={tg} is invalid: at "
                              f"most n_group={g} groups can be eligible")
        if g > 1 and cfg.num_experts // g < 2:
            raise ConfigError(f"MoEConfig.router_options['n_group']={g} leaves "
                              f"{cfg.num_experts // g} expert per group; a group's score is the "
                              "sum of its top-2 affinities, so groups need at least 2 experts")
        if cfg.top_k > tg * (cfg.num_experts // g):
            raise ConfigError(f"MoEConfig.top_k={cfg.top_k} is invalid with topk_group={tg} "
                              f"groups of {cfg.num_experts // g} experts eligible per token; "
                              "raise topk_group or lower top_k")
        for name in ("routed_scaling_factor", "bias_update_speed"):
            v = opts[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"MoEConfig.router_options['{name}']={v!r} is invalid: it "
                                  "must be a number >= 0")

    replays_choices = True

    def nodes_per_token(self, num_nodes: int) -> int | None:
        """Section 2.1.2's node limit: a token reaches its ``topk_group`` groups only; a node
        holding whole groups (``n_group`` a multiple of the nodes) is reached by at most that
        many, a group spread over ``num_nodes / n_group`` nodes reaches that many each. Groups
        that straddle nodes otherwise: no bound given."""
        g, tg = self.opts["n_group"], self.opts["topk_group"]
        if g % num_nodes == 0:
            return tg
        if num_nodes % g == 0:
            return tg * (num_nodes // g)
        return None

    def forward(self, x: torch.Tensor, chosen: torch.Tensor | None = None) -> Routing:
        """``chosen``: the choices of a checkpoint's first forward, replayed by its
        recomputation (:mod:`moeflow.plan_record`): the gates are computed at them and the
        loads are not counted again (the bias update sees each step's loads once)."""
        cfg, o = self.cfg, self.opts
        T, E, k = x.shape[0], cfg.num_experts, cfg.top_k
        dt = torch.promote_types(x.dtype, torch.float32)
        logits = x.to(dt) @ self.weight.to(dt)
        if self.training and cfg.gate_noise > 0:
            logits = logits + torch.randn_like(logits) * cfg.gate_noise
        scores = torch.sigmoid(logits)                                       # Eq. 15
        biased = scores.detach() + self.e_score_correction_bias.to(dt)       # selection only
        g = o["n_group"]
        if g > 1:
            group_scores = biased.view(T, g, E // g).topk(2, dim=-1).values.sum(-1)
            groups = group_scores.topk(o["topk_group"], dim=-1).indices
            mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0)
            biased = biased.masked_fill(mask.repeat_interleave(E // g, 1) == 0, float("-inf"))
        experts = biased.topk(k, dim=-1).indices if chosen is None else chosen
        weights = scores.gather(1, experts)                                  # unbiased s_i
        if cfg.renormalize is not False:                                     # Eq. 16
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * o["routed_scaling_factor"]
        if self.training and o["bias_update_speed"] > 0 and chosen is None:
            with torch.no_grad():
                flat = experts.reshape(-1)
                self.load.index_add_(0, flat, torch.ones_like(flat, dtype=self.load.dtype))
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)          # Eq. 18-19
        lb = balance_loss(probs, experts, E, cfg.balance_loss)
        zl = z_loss(logits)
        return Routing(experts=experts, weights=weights,
                       aux_loss=cfg.aux_loss_coef * lb + cfg.z_loss_coef * zl,
                       balance_loss=lb.detach(), z_loss=zl.detach())

    @torch.no_grad()
    def update_bias(self, total_load: torch.Tensor) -> None:
        """``b_i += gamma * sign(mean load - load_i)`` (section 2.1.2), then reset the load."""
        gamma = self.opts["bias_update_speed"]
        b = self.e_score_correction_bias
        b.add_(gamma * torch.sign(total_load.mean() - total_load).to(b.dtype))
        self.load.zero_()


@torch.no_grad()
def update_router_biases(model: nn.Module, topo=None) -> int:
    """Apply the auxiliary-loss-free bias update of every DeepSeek-V3 router in ``model``,
    with the loads of all ranks since the last call summed in one all-reduce over the world
    (the routers are replicated, so every rank gets the same bias). Call it after each
    optimizer step, on every rank; returns how many routers were updated (0 is a no-op)."""
    routers = [m for m in model.modules()
               if isinstance(m, DeepSeekV3Router) and m.opts["bias_update_speed"] > 0]
    if not routers:
        return 0
    loads = torch.cat([r.load for r in routers])
    if topo is not None and topo.distributed:
        dist.all_reduce(loads, group=topo.world_group)
    for r, load in zip(routers, loads.split([r.load.numel() for r in routers])):
        r.update_bias(load)
    return len(routers)
