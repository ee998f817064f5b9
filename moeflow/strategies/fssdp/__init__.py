"""Expert placements (HECATE's FSSDP): owner shard maps, materialized placements, dispatch
(Sections 3.2, 4.4); FSSDP in the layer is :mod:`.layer_experts`."""

from moeflow.strategies.fssdp.dispatch import candidates, dispatch_plan, rank_loads
from moeflow.strategies.fssdp.placement import Placement

__all__ = ["Placement", "candidates", "dispatch_plan", "rank_loads"]
