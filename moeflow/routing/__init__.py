"""Routers: token -> experts and gate weights, plus the load-balancing losses."""

from moeflow.routing.base import ROUTERS, Router, Routing, register_router
# Importing registers each router under its name.
from moeflow.routing import bilevel_routing, deepseek, topk  # noqa: F401,E402
from moeflow.routing.deepseek import update_router_biases  # noqa: E402

__all__ = ["ROUTERS", "Router", "Routing", "register_router", "update_router_biases"]
