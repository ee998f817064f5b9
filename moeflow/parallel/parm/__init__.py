"""Parm (``docs/parm.md``): MP+EP+ESP layouts and their communication schedules.

Stage 1: the ``baseline`` schedule (Parm Fig. 3a, DeepSpeed-MoE's order) with expert shards.
``collectives`` holds the differentiable ESP data movements, ``baseline`` the schedule.
"""

from moeflow.parallel.parm.baseline import baseline_experts, check_parm_layer

__all__ = ["baseline_experts", "check_parm_layer"]
