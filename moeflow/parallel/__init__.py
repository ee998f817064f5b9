"""Parallelism beyond expert dispatch: gradient synchronisation and the initial broadcast of
replicas (later: Parm's MP+EP+ESP)."""

from moeflow.parallel.replicas import ReplicaMismatchError, check_replicas, prepare_model

__all__ = ["ReplicaMismatchError", "check_replicas", "prepare_model"]
