"""``moeflow bench hecate``'s layer under Zipf-like skewed loads (HECATE Section 5's setting:
expert ``e`` chosen with weight ``rank_e^-s``): its config, inputs, router skew and routing,
shared with ``moeflow simulate layer --measured`` (the fssdp rows' twins)."""

from __future__ import annotations

import numpy as np
import torch

from moeflow.config import MoEConfig
from moeflow.routing.choices import router_choices


def case_config(d_model: int, d_expert: int, num_experts: int, top_k: int) -> MoEConfig:
    """The variants' common layer: dropless, no balancing loss (the variants override it)."""
    return MoEConfig(d_model=d_model, d_expert=d_expert, num_experts=num_experts, top_k=top_k,
                     capacity_factor=None, aux_loss_coef=0.0, seed=1)


def case_input(tokens: int, d_model: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens (feature 0 the constant 1 that the skew weighs)."""
    gen = torch.Generator().manual_seed(4000 + rank)
    x = torch.randn(tokens, d_model, generator=gen)
    x[:, 0] = 1.0
    return x


def case_routing(tokens: int, d_model: int, d_expert: int, num_experts: int, top_k: int,
                 s: float, world: int) -> list[torch.Tensor]:
    """The ``(tokens, top_k)`` expert ids each rank's router picks in ``moeflow bench hecate``'s timed steps at
    skew ``s`` (no drift: the router is built from the config and skewed once, the input is
    the same every step, every variant alike): what ``moeflow simulate layer --measured``
    plans, so its loads and bytes are those of the measured run."""
    return router_choices(case_config(d_model, d_expert, num_experts, top_k),
                          [case_input(tokens, d_model, p) for p in range(world)],
                          lambda router: skew_router(router, num_experts, s))


def skew_router(router, E: int, s: float, rotation: int = 0, loads=None) -> None:
    """Router weights of feature 0 (constant 1 in the input): ``-s * log(rank_e)``; the
    popularity ranks are a fixed shuffle, rotated by ``rotation`` (load drift). With ``loads``
    (a real router's tokens per expert) the weights are ``log(load_e / sum)`` instead (``s``
    ignored), rotated likewise."""
    if loads is not None:
        p = np.asarray(loads, dtype=np.float64)
        if p.shape != (E,) or (p <= 0).any():
            raise ValueError(f"router loads {list(loads)} must be {E} positive counts (one "
                             "per expert)")
        w = np.roll(np.log(p / p.sum()), rotation)
    else:
        w = -s * np.log(np.roll(np.random.default_rng(7).permutation(E) + 1, rotation))
    with torch.no_grad():
        router.weight[0] = torch.tensor(w, dtype=router.weight.dtype)
