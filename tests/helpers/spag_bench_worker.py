"""Rank side of tests/multirank/test_bench_spag.py: ``moeflow bench spag`` and ``moeflow bench
spag-overlap`` (and ``--backward``, ``--regather``) workers on tiny sizes (structure and invariants, not speed)."""

from __future__ import annotations

from benchmarks.hecate import spag, spag_overlap

SPAG = dict(chunk_bytes=4096, experts_per_rank=2, replicas=[3], warmup=0, reps=2)
OVERLAP = dict(d_model=16, n_heads=2, seq_len=8, batch=1, d_expert=16, experts_per_rank=2,
               replicas=3, transports=["p2p", "broadcast"], warmup=0, reps=2)


def worker() -> dict:
    return {"spag": spag.bench_worker(SPAG), "overlap": spag_overlap.bench_worker(OVERLAP),
            "backward": spag_overlap.backward_worker(dict(OVERLAP, transports=["p2p"])),
            "regather": spag_overlap.regather_worker(dict(OVERLAP, transports=["p2p"]))}
