"""Float64 parity cases for Parm's S1 and S2 schedules, SAA vs AAS and Algorithm 1 (importable
by spawned ranks; the layouts and the reference conventions of ``tests/helpers/parm_cases.py``).

S2 gates the whole MP-replicated batch, so its reference is the baseline's (each rank's batch
as its own local batch). S1 gates ``1/N_MP`` of it: its reference runs each MP part of a rank's
batch as a batch of its own (capacity and balancing loss per part), concatenates the outputs,
and takes the mean of the parts' auxiliary losses, which is what S1's layer reports.
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow import MoELayer, Topology
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.config import ConfigError, MoEConfig
from moeflow.strategies.parm.fits import ParmFits, measure_parm_fits
from moeflow.strategies.parm.s1 import token_rows
from moeflow.strategies.parm.s2 import mp_slots
from moeflow.strategies.parm.saa import aas, saa
from tests.helpers import parity
from tests.helpers.parm_cases import CASES, batch_index, run_rank, topology

SCHEDULES = {
    "s1": dict(parallel_schedule="s1"),
    "s2_saa": dict(parallel_schedule="s2", parm_check_plan=True),
    "s2_aas": dict(parallel_schedule="s2", parm_saa=False, parm_check_plan=True),
}
#: 8 ranks as 2 nodes x 4: (N_MP, N_EP, N_ESP) = (2, 2, 2), both placements (Section IV-A)
LAYOUTS_8 = {"mp2_ep2_esp2_esp_in_node": (2, 2, 2, True),
             "mp2_ep2_esp2_ep_in_node": (2, 2, 2, False)}
#: the baseline and the ted schedule (beyond the paper, tests/multirank/test_parm_ted.py on 4
#: ranks) beside the schedules, on the 4-rank cases (tiny tensors: the cases take a few
#: seconds, the spawn of 8 ranks the rest)
SCHEDULES_8 = {"baseline": {}, **SCHEDULES,
               "ted": dict(parallel_schedule="ted", parm_check_plan=True),
               # the pipelined ted (ted_pipelined.py): MP, EP and ESP groups all of 2 ranks
               "ted_r2": dict(parallel_schedule="ted", parm_check_plan=True, pipeline_degree=2,
                              schedule="pipelined")}
# composability on one layout: BigMac (exact), a lossy codec with chunks and OptSche on the
# EP&ESP payloads (close to the reference: bf16 rounding)
EXTRAS_LAYOUT = "mp2_esp2_esp_in_node"
EXTRAS = {
    "bigmac_s1": ("s1", "bigmac_swiglu_capacity", {}),
    "bigmac_s2": ("s2_saa", "bigmac_swiglu_capacity", {}),
    "pairwise_s2": ("s2_aas", "capacity_k2", dict(a2a="pairwise")),
    "codec_chunks_s1": ("s1", "dropless_k2",
                        dict(codec="bf16", pipeline_degree=2, schedule="optsche")),
    "codec_chunks_s2_aas": ("s2_aas", "dropless_k2",
                            dict(codec="bf16", pipeline_degree=2, schedule="optsche")),
}


def schedule_cases(schedule: str) -> list[str]:
    """AAS shares S2-SAA's code but the exchange: two cases (one chunked) suffice for it (the
    baseline, on 8 ranks, takes them all)."""
    if schedule == "s2_aas":
        return ["dropless_k2", "expert_bias_capacity"]
    return list(CASES)


def overrides(schedule: str, case: str) -> dict:
    kw = {**CASES[case], **SCHEDULES_8[schedule]}
    if schedule in ("s2_saa", "ted"):    # SAA and ted take no chunks (refused)
        kw.pop("pipeline_degree", None)
    return kw


def rank_worker(layouts: list[str]) -> dict:
    out = {}
    for layout in layouts:
        topo = topology(layout)
        for schedule in SCHEDULES:
            for case in schedule_cases(schedule):
                out[(layout, schedule, case)] = run_rank(case, topo, **overrides(schedule, case))
        if topo.mp_size > 1:
            out[(layout, "saa_vs_aas")] = saa_vs_aas(topo)
        out[(layout, "auto")] = auto_choices(topo)
    topo = topology(EXTRAS_LAYOUT)
    for key, (schedule, case, kw) in EXTRAS.items():
        out[("extra", key)] = run_rank(case, topo, **{**SCHEDULES[schedule], **kw})
    out["errors"] = layer_errors(topology("mp2_esp2_esp_in_node"))
    out["fits"] = measure_parm_fits(topology("mp2_ep2"), elements=(256, 1024), width=8,
                                    warmup=0, reps=1).to_json()
    return out


def topology_8(layout: str) -> Topology:
    mp, ep, esp, in_node = LAYOUTS_8[layout]
    return Topology.from_env(ep_size=ep, local_size=4, mp_size=mp, esp_size=esp,
                             esp_in_node=in_node)


def rank_worker_8() -> dict:
    """Every (layout, schedule, case) of the 8-rank grid, and SAA vs AAS (4 phases) per
    layout, in one spawn."""
    out = {}
    for layout in LAYOUTS_8:
        topo = topology_8(layout)
        for schedule in SCHEDULES_8:
            for case in schedule_cases(schedule):
                out[(layout, schedule, case)] = run_rank(case, topo, **overrides(schedule, case))
        out[(layout, "saa_vs_aas")] = saa_vs_aas(topo)
    return out


def saa_vs_aas(topo: Topology) -> dict:
    """Random unequal splits (the block's matrix from a seed shared by the block), random rows
    and output gradients: SAA's and AAS's outputs and input gradients."""
    u, me = topo.expert_slots, topo.expert_slot
    block = topo.rank // u
    gen = torch.Generator().manual_seed(100 + block)
    S = torch.randint(0, 5, (u, u), generator=gen).numpy()
    slots = mp_slots(topo)
    ag = np.stack([S[q] for q in slots])                # rows MP rank m gets from slot p
    first = topo.rank - me
    args = (S[:, me].tolist(), S[me].tolist(), ag, me, slots, topo.mp_rank,
            [first + p for p in range(u)], topo.ep_esp_group, topo.mp_group)
    y = torch.randn(int(S[:, me].sum()), 3, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(topo.rank))
    g = torch.randn(int(ag.sum()), 3, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(50 + topo.rank))
    res = {}
    for name, fn in (("saa", saa), ("aas", aas)):
        x = y.clone().requires_grad_()
        out = fn(x, *args)
        out.backward(g)
        res[name] = (out.detach(), x.grad)
    return res


def auto_choices(topo: Topology) -> dict:
    """``auto`` with synthetic fits that make S1 (resp. S2) the faster: the schedule taken and
    the output, to compare with the fixed schedules'."""
    cheap, dear = AlphaBeta(1e-6, 1e-12), AlphaBeta(1e-3, 1e-6)
    fits = {"s1": ParmFits(ag_mp=cheap, a2a=cheap, overlap=dear),
            "s2": ParmFits(ag_mp=dear, a2a=cheap, overlap=cheap)}
    out = {}
    for want, f in fits.items():
        layer = parity.make_layer("capacity_k2", topo, parallel_schedule="auto",
                                  parm_auto_measure=False)      # Algorithm 1 alone
        layer.strategy.parts.auto.fits = f
        x, _ = parity.make_batch("capacity_k2", batch_index(topo.rank, topo.mp_size))
        y = layer(x)
        out[want] = (layer.strategy.parts.auto.last.schedule, y.detach())
    return out


def layer_errors(topo: Topology) -> dict[str, str]:
    bad = {"saa_codec": dict(parallel_schedule="s2", codec="int8"),
           "saa_chunks": dict(parallel_schedule="auto", pipeline_degree=2),
           "noise": dict(parallel_schedule="s2", gate_noise=0.1),
           "a2a": dict(parallel_schedule="s1", a2a="hier1d")}
    errors = {}
    for key, kw in bad.items():
        try:
            MoELayer(MoEConfig(d_model=8, num_experts=4, d_expert=8, **kw), topo)
        except ConfigError as e:
            errors[key] = str(e)
    return errors


def reference_s1(name: str, world: int, mp: int, **kw) -> dict:
    """One process; rank r's batch runs as its MP parts, each a batch of its own."""
    return reference_parts(name, world, mp, mp, **kw)


def reference_parts(name: str, world: int, mp: int, parts_per_batch: int, **kw) -> dict:
    """One process; rank r's batch (shared by its MP group) runs as ``parts_per_batch`` parts,
    each a batch of its own (1: the whole batch, the reference of the baseline and S2)."""
    layer = parity.make_layer(name, Topology.single(), **kw)
    ys, xs, auxs, total = [], [], [], 0.0
    for r in range(world):
        x, g = parity.make_batch(name, batch_index(r, mp))
        x.requires_grad_()
        parts, losses = [], []
        for rows in token_rows(x.shape[0], parts_per_batch):
            parts.append(layer(x[rows.start:rows.stop]))
            losses.append(layer.aux_loss)
        y, aux = torch.cat(parts), torch.stack(losses).mean()
        total = total + (y * g).sum() / max(1, y.shape[0]) + aux
        ys.append(y.detach())
        xs.append(x)
        auxs.append(aux.detach())
    (total / world).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()], 2.0)
    grads, params = parity._snapshot(layer)
    return {"y": ys, "x_grad": [x.grad for x in xs], "aux": auxs, "grads": grads,
            "params": params, "norm": norm}


def check_eight_ranks() -> None:
    """Baseline, S1, S2 (SAA), S2 (AAS), ted and ted in 2 pipelined chunks at (N_MP, N_EP,
    N_ESP) = (2, 2, 2) on 8 ranks as 2 nodes x 4, both placements, the cases of
    ``schedule_cases`` (capacity and dropless, top-2, biases and SwiGLU, 2 chunks, shared
    experts), against the single-process references;
    SAA == AAS (outputs and input gradients) bit for bit with 4 phases.
    ``tests/multirank/test_parm_schedules.py``, or ``python -m tests.helpers.parm_sched_cases``."""
    from moeflow.launch import launch_local
    from tests.helpers import parm_cases

    world = 8
    got = launch_local(rank_worker_8, world, timeout_s=300)
    refs = {}
    for layout, (mp, *_) in LAYOUTS_8.items():
        for schedule in SCHEDULES_8:
            for name in schedule_cases(schedule):
                kind = "s1" if schedule == "s1" else "whole"
                if (kind, mp, name) not in refs:
                    refs[(kind, mp, name)] = (
                        reference_s1(name, world, mp, **CASES[name]) if kind == "s1"
                        else parm_cases.reference(name, world, mp))
                for rank in range(world):
                    parm_cases.assert_rank_matches(
                        got[rank][(layout, schedule, name)], refs[(kind, mp, name)], rank,
                        world, f"(8 ranks, {layout}, {schedule}, {name})")
        for rank in range(world):
            res = got[rank][(layout, "saa_vs_aas")]
            assert res["saa"][0].numel() > 0 and res["saa"][1].numel() > 0, (layout, rank)
            for i in range(2):
                torch.testing.assert_close(res["saa"][i], res["aas"][i], rtol=0, atol=0)
    print(f"8 ranks, {LAYOUTS_8}: {list(SCHEDULES_8)} x their cases match; SAA == AAS")


if __name__ == "__main__":
    check_eight_ranks()
