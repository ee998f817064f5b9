"""Expert placements (HECATE's FSSDP): owner shard maps, materialized placements, dispatch."""

from moeflow.placement.dispatch import candidates, dispatch_plan, rank_loads, token_destinations
from moeflow.placement.placement import Placement

__all__ = ["Placement", "candidates", "dispatch_plan", "rank_loads", "token_destinations"]
