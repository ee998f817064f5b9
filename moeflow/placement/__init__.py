"""Expert placements (HECATE's FSSDP): owner shard maps, materialized placements, dispatch,
and the sharded expert storage (Sections 3.2, 4.4)."""

from moeflow.placement.dispatch import candidates, dispatch_plan, rank_loads, token_destinations
from moeflow.placement.fssdp import ShardedExperts
from moeflow.placement.placement import Placement

__all__ = ["Placement", "ShardedExperts", "candidates", "dispatch_plan", "rank_loads",
           "token_destinations"]
