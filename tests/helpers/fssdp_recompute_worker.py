"""Rank side of tests/multirank/test_recompute.py's FSSDP cases: ``MoEConfig.recompute="moe_act"``
with ``placement="fssdp"`` (HECATE Section 3.2) against ``recompute="none"``, on 4 float64 ranks.

Each variant runs ``recompute_plan_worker.STEPS`` AdamW steps of one layer per recompute mode
(``recompute_plan_worker.run`` without a checkpoint) and records per step the output, the input
gradient, the experts' (slot rows) and the dense gradients and values after the step, ``P'``,
the bytes the forward's held experts still hold between forward and backward, and whether the
scheduled exchange kept the experts' input rows rather than their graphs.
"""

from __future__ import annotations

import contextlib

import moeflow.schedule.pipeline as pipeline
from moeflow import Topology
from tests.helpers import recompute_plan_worker as rp

R2 = dict(schedule="optsche", pipeline_degree=2)
VARIANTS = {
    # Algorithm 1 from the load window, calibration after the gate, HECATE-RM (the held
    # experts freed after the forward, re-gathered by a second spAG before its backward)
    "fssdp_rm_r1": rp.SPARSE,
    # no re-materialization: the held experts stay until the backward; r = 2, OptSche
    "fssdp_keep_r2": dict(rp.SPARSE, fssdp=dict(rp.SPARSE["fssdp"], rematerialize=False),
                          **R2),
}
MODES = ("none", "moe_act")


@contextlib.contextmanager
def recording(kept: list):
    """Append each scheduled exchange's choice (input rows kept: True) to ``kept``."""
    saves = pipeline.ScheduledExperts.saves_inputs

    def recorded(self):
        kept.append(saves(self))
        return kept[-1]

    pipeline.ScheduledExperts.saves_inputs = recorded
    try:
        yield
    finally:
        pipeline.ScheduledExperts.saves_inputs = saves


def worker(variants: list[str]) -> dict:
    topo = Topology.from_env(local_size=rp.LOCAL)
    out = {}
    for v in variants:
        for mode in MODES:
            kept: list = []
            with recording(kept):
                out[v, mode] = rp.run(topo, dict(VARIANTS[v], recompute=mode), None)
            out[v, mode, "kept_inputs"] = kept
    return out
