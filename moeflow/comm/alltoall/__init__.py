"""All-to-all algorithms (ScheMoE section 3.1 "AbsAlltoAll", section 5).

Each algorithm moves row blocks between the ranks of the expert-parallel group with given split
sizes; the layer does not know which one runs.
"""

from moeflow.comm.alltoall.base import ALLTOALLS, AllToAll, Pending, register_alltoall
from moeflow.comm.alltoall import direct as _direct  # noqa: F401  (registers "direct")

__all__ = ["ALLTOALLS", "AllToAll", "Pending", "register_alltoall"]
