"""Importable by spawned ranks: ``benchmarks.parm.parm_collectives`` on two layouts of 4 ranks
(2 nodes x 2), tiny sizes, synthetic fits beside fits measured here."""

from __future__ import annotations

import torch

from moeflow.measure.linkmodel import AlphaBeta
from benchmarks.parm.parm import crossing
from benchmarks.parm.parm_collectives import measure_baseline_fits, messages, time_case
from moeflow.strategies.parm.fits import measure_parm_fits
from moeflow.topology import Topology

SYNTHETIC = AlphaBeta(1e-4, 1e-9)


def rank_worker() -> dict:
    out = {"crossing": {}}
    device = torch.device("cpu")
    for mp, ep, esp in ((1, 2, 2), (2, 2, 1)):
        topo = Topology.from_env(ep_size=ep, local_size=2, mp_size=mp, esp_size=esp)
        out["crossing"][f"{mp},{ep},{esp}"] = crossing(topo)
        sizes = (2048, 8192)
        pf = measure_parm_fits(topo, elements=sizes, width=16, warmup=0, reps=1)
        bf = measure_baseline_fits(topo, sizes, width=16, warmup=0, reps=1)
        measured = {"ag_mp": pf.ag_mp, "a2a": pf.a2a, "overlap": pf.overlap,
                    **{k: v for k, v in bf.items() if k != "points"}}
        synthetic = {k: SYNTHETIC for k in ("ag_mp", "a2a", "overlap", "ag_esp", "a2a_ep",
                                             "ar_esp")}
        msgs = messages(topo, 64, 16, 2 * ep, 2, 1.2)
        out[f"{mp},{ep},{esp}"] = time_case(topo, msgs, {"synthetic": synthetic,
                                                          "measured": measured},
                                            16, device, warmup=0, reps=2)
    topo = Topology.from_env(ep_size=2, local_size=2, mp_size=1, esp_size=2,
                             esp_in_node=False)                  # ESP groups across nodes
    out["crossing"]["1,2,2e"] = crossing(topo)
    return out
