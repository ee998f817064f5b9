"""Expert networks: the local experts of one rank, computed as a group."""

from moeflow.experts.ffn import ExpertFFN
from moeflow.experts.structure import DCCAProjections, comm_width, expert_hidden

__all__ = ["DCCAProjections", "ExpertFFN", "comm_width", "expert_hidden"]
