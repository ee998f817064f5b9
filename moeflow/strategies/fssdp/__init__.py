"""HECATE's fully sharded sparse data parallelism (FSSDP) as one strategy: the strategy
(:mod:`.strategy`), its options (:mod:`.options`), the owner-sharded experts in the layer
(:mod:`.layer_experts`), placements and their dispatch (Sections 3.2, 4.4), re-sharding
(Algorithm 2), re-placement, checkpoint entries and training metrics."""

from moeflow.strategies.fssdp.topology_dispatch import candidates, dispatch_plan, rank_loads
from moeflow.strategies.fssdp.placement import Placement

__all__ = ["Placement", "candidates", "dispatch_plan", "rank_loads"]
