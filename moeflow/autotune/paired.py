"""The tuner's placement screen with ``placement="auto"``: expert parallelism against the
node-deduplicated exchange (DeepEP's inter-node dispatch) timed in paired, interleaved
repetitions, decided by the median of the pairs' ratios.

Two back-to-back blocks of 1 warm-up + 2 steps per candidate let a slow spell of the shared
cluster (another job's traffic, a host hiccup) fall on one candidate only, and a real 1.5x
gain of ``node_dedup`` was missed once in three runs that way. Interleaving (EP, node_dedup,
EP, node_dedup, ...) puts both candidates of a pair in the same spell, and the median of the
per-pair ratios ignores the pairs a spell still split. The rule is the one of
:func:`moeflow.autotune.tuner.pick` (ScheMoE section 3.2 profiles on the running cluster;
the simpler candidate wins within the margin): ``node_dedup`` wins only where the median
pair has expert parallelism slower by more than ``margin``; a tie keeps expert parallelism.
"""

from __future__ import annotations

import statistics

PAIRED_REPS = 5          # interleaved (EP, node_dedup) pairs after one warm-up of each
# (timed by moeflow.measure.timing.paired_times)


def dedup_wins(ep_s: list[float], dedup_s: list[float], margin: float) -> bool:
    """Whether the node-deduplicated exchange beats expert parallelism by more than
    ``margin``: the median over pairs i of ``ep_s[i] / dedup_s[i]`` exceeds ``1 + margin``.
    ``ep_s[i]`` and ``dedup_s[i]`` are the slowest rank's times of the i-th interleaved
    pair (equal on every rank, so is the answer)."""
    if len(ep_s) != len(dedup_s) or not ep_s:
        raise ValueError(f"paired timings need the same non-zero count, got {len(ep_s)} "
                         f"expert-parallel and {len(dedup_s)} node_dedup times")
    if any(t <= 0.0 for t in dedup_s):
        raise ValueError(f"node_dedup times must be positive, got {dedup_s}")
    return statistics.median(e / d for e, d in zip(ep_s, dedup_s)) > 1.0 + margin
