"""``moeflow bench parm``'s layer (Parm Section V's Table III grid, ``H = 2 M``): its config, the
inputs of each MP group and the routing, shared with ``moeflow simulate layer --measured``
(the parm rows' twins)."""

from __future__ import annotations

import torch

from moeflow.config import MoEConfig
from moeflow.routing.choices import router_choices


def case_config(d_model: int, num_experts: int, top_k: int, capacity_factor: float,
                capacity_padding: str | None = None) -> MoEConfig:
    """The MoE layer of one grid case (``H = 2 M``; the variants override the schedule);
    ``capacity_padding``: None keeps the config's default."""
    extra = {} if capacity_padding is None else {"capacity_padding": capacity_padding}
    return MoEConfig(d_model=d_model, d_expert=2 * d_model, num_experts=num_experts,
                     top_k=top_k, capacity_factor=capacity_factor, seed=1, **extra)


def case_input(tokens: int, d_model: int, mp_group: int) -> torch.Tensor:
    """The tokens of MP group ``mp_group`` (rank // N_MP): every rank of the group holds them."""
    gen = torch.Generator().manual_seed(4000 + mp_group)
    return torch.randn(tokens, d_model, generator=gen)


def case_routing(tokens: int, d_model: int, num_experts: int, top_k: int,
                 capacity_factor: float, world: int, mp: int) -> list[torch.Tensor]:
    """The ``(tokens, top_k)`` expert ids the router picks on each rank's input in
    ``moeflow bench parm``'s timed steps (rank ``p`` gates MP group ``p // mp``'s batch; the router is built
    from the config alone and no step changes it, every variant alike): what ``moeflow
    simulate layer --measured`` plans, so its bytes are those of the measured run."""
    return router_choices(case_config(d_model, num_experts, top_k, capacity_factor),
                          [case_input(tokens, d_model, p // mp) for p in range(world)])
