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
    """Maps ``x: (T, d_model)`` to a :class:`Routing`; built from a ``MoEConfig``."""

    name: str = "?"

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    @classmethod
    def check_topology(cls, cfg, topo) -> None:
        """Raise ConfigError if this router cannot place its experts on ``topo``."""


ROUTERS = Registry("router", Router)
register_router = ROUTERS.register
