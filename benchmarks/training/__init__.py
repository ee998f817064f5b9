"""End-to-end ``moeflow train`` experiments: activation recomputation, dense-parameter sharding
and a trained router's per-expert loads, started as ``moeflow bench recompute``,
``dense-shard`` and ``router-load``."""
