"""How much of the all-to-all a schedule hides: the fraction of communication time during
which a computing task also ran (ScheMoE section 4: the point of pipelining and OptSche).

Computed from timeline records (``TaskRecord``: lane, phase, start, end), which on CUDA come
from events on the two lanes' streams and on CPU from the host clock. Imports nothing from
moeflow: ``Timeline.overlap_fraction`` (:mod:`moeflow.schedule.executor`) uses it, and the
measuring harness (:mod:`moeflow.bench.overlap_bench`, the ``overlap`` column of ``moeflow bench layer``) sits above.
"""

from __future__ import annotations


def overlap_fraction(records, phase: str | None = None) -> float:
    """Fraction of comm-lane time covered by compute-lane tasks (0 without communication)."""
    recs = [r for r in records if phase is None or r.phase == phase]
    comp = [(r.start, r.end) for r in recs if r.lane == "compute"]
    total = hidden = 0.0
    for r in recs:
        if r.lane != "comm":
            continue
        total += r.end - r.start
        hidden += sum(max(0.0, min(r.end, ce) - max(r.start, cs)) for cs, ce in comp)
    return min(1.0, hidden / total) if total > 0 else 0.0
