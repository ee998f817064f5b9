"""The expert ids a router built from a config alone picks on given inputs, without a layer or
a step: what a benchmark's timed steps route when no step changes the router, and what
``moeflow simulate`` plans so that its bytes and loads are those of the measured run."""

from __future__ import annotations

import torch

from moeflow.routing.base import ROUTERS


def router_choices(cfg, inputs: list[torch.Tensor], prepare=None
                   ) -> list[torch.Tensor]:
    """The ``(tokens, top_k)`` expert ids a router built from ``cfg`` alone picks on each of
    ``inputs`` (``prepare(router)`` first, e.g. bench hecate's skew): the routing a bench's
    timed steps use when no step changes the router, which ``moeflow simulate`` plans."""
    router = ROUTERS[cfg.router](cfg)
    if prepare is not None:
        prepare(router)
    with torch.no_grad():
        return [router(x).experts for x in inputs]
