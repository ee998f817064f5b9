"""Expert networks: the local experts of one rank, computed as a group."""

from moeflow.experts.ffn import ExpertFFN

__all__ = ["ExpertFFN"]
