"""Routers: token -> experts and gate weights, plus the load-balancing losses."""

from moeflow.routing.base import ROUTERS, Router, Routing, register_router
from moeflow.routing import topk as _topk  # noqa: F401  (registers "topk")

__all__ = ["ROUTERS", "Router", "Routing", "register_router"]
