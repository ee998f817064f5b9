"""MoELayer: route -> plan -> permute -> encode/all-to-all/decode -> experts -> back -> combine.

The steps of DESIGN.md "One MoE layer"; each part is chosen by name in ``MoEConfig`` from its
registry (router, codec, all-to-all algorithm), so later parts plug in without changing this file.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.comm.alltoall import ALLTOALLS
from moeflow.comm.codecs import CODECS
from moeflow.comm.exchange import exchange
from moeflow.config import ConfigError, MoEConfig
from moeflow.dispatch import capacity, combine, group_by_expert, make_plan, permute, ungroup
from moeflow.experts import ExpertFFN
from moeflow.experts.structure import build_projections, comm_width, expert_hidden
from moeflow.phases import NULL_TIMER, PhaseTimer
from moeflow.routing import ROUTERS
from moeflow.topology import Topology


class MoELayer(nn.Module):
    """A Mixture-of-Experts FFN: ``y = sum_j g_j(x) E_{e_j(x)}(x)`` over the top-k experts
    (BigMac: ``y = (sum_j g_j(x) E_{e_j(x)}(x W_d)) W_u``, see ``experts/structure.py``).

    ``x: (..., d_model) -> (..., d_model)``. After each forward, ``aux_loss`` holds the router's
    scaled auxiliary loss (add it to the training loss) and ``stats`` the unscaled terms and the
    fraction of routing choices dropped by capacity.
    """

    def __init__(self, cfg: MoEConfig, topo: Topology | None = None):
        super().__init__()
        topo = topo or Topology.single()
        if cfg.num_experts % topo.ep_size:
            raise ConfigError(
                f"MoEConfig.num_experts={cfg.num_experts} is invalid for an expert-parallel size "
                f"of {topo.ep_size}: it must be a multiple of it; use "
                f"{-(-cfg.num_experts // topo.ep_size) * topo.ep_size} experts or a smaller "
                "ep_size")
        self.cfg, self.topo = cfg, topo
        self.num_local = cfg.num_experts // topo.ep_size
        self.router = ROUTERS[cfg.router](cfg)
        self.dcca = build_projections(cfg)      # BigMac's W_d / W_u; None for other structures
        self.experts = ExpertFFN(comm_width(cfg), expert_hidden(cfg),
                                 topo.ep_rank * self.num_local, self.num_local, cfg.activation,
                                 cfg.seed, cfg.layer_id)
        self.algo = ALLTOALLS[cfg.a2a](topo)
        self.codec = CODECS[cfg.codec]()
        self.timer: PhaseTimer | None = None
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict[str, float] = {}

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"structure={c.structure}, experts={c.num_experts} (local {self.num_local}), "
                f"top_k={c.top_k}, "
                f"capacity_factor={c.capacity_factor}, router={c.router}, codec={c.codec}, "
                f"a2a={c.a2a}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, t = self.cfg, self.timer or NULL_TIMER
        if x.shape[-1] != cfg.d_model:
            raise ValueError(f"MoELayer input has last dimension {x.shape[-1]} but "
                             f"MoEConfig.d_model={cfg.d_model}; reshape the input or build the "
                             f"layer with d_model={x.shape[-1]}")
        shape = x.shape
        h = x.reshape(-1, cfg.d_model)
        with t.phase("route", h):
            routing = self.router(t.mark(h, "route"))     # the router reads x (pre-descend)
        if self.dcca is not None:                          # BigMac: descend before dispatch
            with t.phase("project", h):
                h = self.dcca.down(t.mark(h, "project"))
        cap = (None if cfg.dropless else
               capacity(h.shape[0], cfg.top_k, cfg.num_experts, cfg.capacity_factor))
        with t.phase("permute", h):
            plan = make_plan(routing.experts, cfg.num_experts, cap, self.algo)
            send = permute(t.mark(h, "permute"), plan)
        with t.phase("all_to_all", h):
            recv = exchange(t.mark(send, "all_to_all"), self.algo, self.codec,
                            plan.send_splits, plan.recv_splits)
        with t.phase("experts", h):
            grouped, counts, perm = group_by_expert(t.mark(recv, "experts"), plan.recv_counts)
            out = ungroup(self.experts(grouped, counts), perm)
        with t.phase("all_to_all", h):
            back = exchange(t.mark(out, "all_to_all"), self.algo, self.codec,
                            plan.recv_splits, plan.send_splits)
        with t.phase("combine", h):
            y = combine(t.mark(back, "combine"), plan, routing.weights)
        if self.dcca is not None:                          # BigMac: ascend after combine
            with t.phase("project", y):
                y = self.dcca.up(t.mark(y, "project"))
        self.aux_loss = routing.aux_loss
        n_choices = max(1, routing.experts.numel())
        self.stats = {"balance_loss": float(routing.balance_loss),
                      "z_loss": float(routing.z_loss),
                      "dropped_fraction": plan.dropped / n_choices}
        return t.mark(y, None).reshape(shape)
