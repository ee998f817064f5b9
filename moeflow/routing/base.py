"""The router interface, its result, and its registry."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeflow.registry import Registry


@dataclass
class Routing:
    """Where each token goes.

    experts: (T, k) global expert ids, choice j of token t at [t, j] (choice 0 is the best).
    weights: (T, k) gate weights the expert outputs are scaled by (router precision).
    aux_loss: scalar, already multiplied by its coefficients; add it to the training loss.
    balance_loss / z_loss: the unscaled terms, detached, for logging.
    """

    experts: torch.Tensor
    weights: torch.Tensor
    aux_loss: torch.Tensor
    balance_loss: torch.Tensor
    z_loss: torch.Tensor


class Router(nn.Module):
    """Maps ``x: (T, d_model)`` to a :class:`Routing`; built from a ``MoEConfig``.

    A router that can route with another k than ``cfg.top_k`` for one call (``layer(x,
    top_k=...)``) accepts ``forward(x, top_k=k)`` and overrides :meth:`check_top_k`; the layer
    passes ``top_k`` only when it differs from the config's.
    """

    name: str = "?"
    #: Whether ``forward(x, ..., chosen=experts)`` takes given choices ``(T, k)``: the expert
    #: ids come from ``chosen`` and the gates are computed at them (with gradient). A
    #: checkpoint's recomputation replays the first forward's choices this way
    #: (:mod:`moeflow.plan_record`); a router without it routes again (the same choices when
    #: its recomputation is deterministic).
    replays_choices: bool = False
    #: The router's own settings (``MoEConfig.router_options``) and their defaults.
    OPTIONS: dict = {}

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    @classmethod
    def check_options(cls, cfg) -> dict:
        """``cfg.router_options`` completed with :attr:`OPTIONS`' defaults; ConfigError for a
        name this router does not know. Routers with options override :meth:`validate_options`
        to check their values."""
        from moeflow.registry import completed_options

        opts = completed_options("router_options", "router", cfg.router, cfg.router_options,
                                 cls.OPTIONS)
        cls.validate_options(cfg, opts)
        return opts

    @classmethod
    def validate_options(cls, cfg, opts: dict) -> None:
        """Raise ConfigError for an invalid value in ``opts`` (all names known)."""

    @classmethod
    def check_top_k(cls, cfg, k: int) -> None:
        """Raise ConfigError unless this router can route one call with top-``k``."""
        from moeflow.errors import ConfigError

        raise ConfigError(f"MoELayer(x, top_k={k}) is invalid: router {cfg.router!r} "
                          f"({cls.__module__}.{cls.__qualname__}) takes no per-call top_k; "
                          f"build a layer with MoEConfig.top_k={k} instead")

    @classmethod
    def check_topology(cls, cfg, topo) -> None:
        """Raise ConfigError if this router cannot place its experts on ``topo``."""

    def nodes_per_token(self, num_nodes: int) -> int | None:
        """The most distinct nodes (``num_nodes`` equal blocks of consecutive experts) one
        token's choices can reach, when the router limits it below ``top_k``
        (node-limited routing); None: no limit of its own. The node-deduplicated exchange
        sizes its capacity per node by it (:mod:`moeflow.strategies.node_dedup.node_capacity`)."""
        return None


ROUTERS = Registry("router", Router)
register_router = ROUTERS.register
