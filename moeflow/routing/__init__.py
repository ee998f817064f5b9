"""Routers: token -> experts and gate weights, plus the load-balancing losses."""

from moeflow.routing.base import ROUTERS, Router, Routing, register_router
# Importing registers each router under its name.
from moeflow.routing import bilevel, topk  # noqa: F401,E402

__all__ = ["ROUTERS", "Router", "Routing", "register_router"]
