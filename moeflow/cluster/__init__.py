"""The emulated multi-node cluster (docs/design.md, "Emulated cluster"): network namespaces as nodes,
shaped veth links between them, and torchrun started inside each (``moeflow cluster run``)."""

from moeflow.cluster.netns import (ClusterError, EmulatedNetwork, Node, check_privileges,
                                   cleanup_leftovers)
from moeflow.cluster.shaping import LinkShape, parse_latency, parse_rate

__all__ = ["ClusterError", "EmulatedNetwork", "LinkShape", "Node", "check_privileges",
           "cleanup_leftovers", "parse_latency", "parse_rate"]
