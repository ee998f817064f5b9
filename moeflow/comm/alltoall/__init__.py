"""All-to-all algorithms (ScheMoE section 3.1 "AbsAlltoAll", section 5).

Each algorithm moves row blocks between the ranks of the expert-parallel group with given split
sizes; the layer does not know which one runs.
"""

from moeflow.comm.alltoall.base import ALLTOALLS, AllToAll, Pending, register_alltoall
# Importing registers each algorithm under its name.
from moeflow.comm.alltoall import (  # noqa: F401,E402
    bilevel, direct, hier1d, hier2d, pairwise, pipe)

__all__ = ["ALLTOALLS", "AllToAll", "Pending", "register_alltoall"]
