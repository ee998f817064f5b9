"""Rank side of tests/multirank/test_recompute_plan.py: a MoE layer under torch.utils.checkpoint
replays its first forward's plan (moeflow/plan_record.py).

Every (variant, mode) runs ``STEPS`` AdamW steps of one float64 layer on this rank's batch,
mode None (no checkpoint), False (non-reentrant) or True (reentrant), and records per step:
the output, the input gradient, the experts' and the dense parameters' gradients and values
after the step, ``P'`` (FSSDP), and counters per step: the router's forwards, the count
exchanges (EP: ``exchange_counts``; FSSDP: ``KeptChoices``; Parm: the EP&ESP block counts;
node_dedup: the gather inside its exchange), Algorithm 1's runs
(``next_placement``), the load window's entries, the bytes the first forward's held experts
still hold between forward and backward (FSSDP), and the DeepSeek-V3 router's counted loads
before its bias update. The loss is ``(y * g).sum() / T`` (the aux loss is not trained: under
a reentrant checkpoint the first forward's aux loss has no graph), the same for every mode.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.utils.checkpoint as ckpt

import moeflow.strategies.parm.ep_esp as ep_esp
import moeflow.strategies.fssdp.layer_experts as layer_experts
import moeflow.schedule.pipeline as pipeline
import moeflow.strategies.node_dedup.trimmed as node_dedup_trimmed
import moeflow.strategies.node_dedup.padded as node_dedup_padded
from moeflow import Topology, sync_gradients, update_router_biases
from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
from tests.helpers import fssdp_layer_worker as fw
from tests.helpers import parity

WORLD, LOCAL, STEPS, LR = 4, 2, 2, 0.02
CASE = "capacity_k2"
R4 = dict(schedule="pipelined", pipeline_degree=4)
SPARSE = dict(placement="fssdp", fssdp=dict(materialize="sparse", overlap_degree=2,
                                            memory_capacity=2, calibrate=True,
                                            bandwidth_Bps=1e12, rematerialize=True))
VARIANTS = {
    "ep_r1": {},
    "ep_r4": R4,
    "deepseek_r1": dict(router="deepseek_v3", router_options=dict(bias_update_speed=0.01)),
    # HECATE Algorithm 1 from the load window, calibration after the gate, HECATE-RM
    "fssdp_sparse_r1": SPARSE,
    "fssdp_sparse_r4": dict(SPARSE, **R4),
    # Parm's S1 (MP-Split before the gate, EP&ESP-AlltoAll, MP-AllGather after), MP = ESP = 2
    "parm_s1_r2": dict(parallel_schedule="s1", pipeline_degree=2, schedule="optsche",
                       layout=(2, 1, 2, True)),
    # the node-deduplicated exchange (2 nodes x 2): its counts are gathered inside the
    # exchange and kept on its plan; trimmed at r = 2 (OptSche) and padded at r = 1
    "node_dedup_r2": dict(placement="node_dedup", pipeline_degree=2, schedule="optsche"),
    "node_dedup_pad_r1": dict(placement="node_dedup", capacity_padding="pad"),
}
MODES = {"plain": None, "nonreentrant": False, "reentrant": True}
# the default run; the others: slow
DEFAULT = ["ep_r4", "deepseek_r1", "fssdp_sparse_r1", "parm_s1_r2", "node_dedup_r2",
           "node_dedup_pad_r1"]


@contextlib.contextmanager
def counting(layer, counts: dict):
    """Count the router's forwards, the count exchanges, Algorithm 1's runs and the window's
    entries into ``counts`` while inside."""
    def bump(key):
        counts[key] = counts.get(key, 0) + 1

    hook = layer.router.register_forward_hook(lambda *_: bump("router_forwards"))
    exchange, kept = pipeline.exchange_counts, layer_experts.KeptChoices

    def exchange_counting(*a, **k):
        bump("count_exchanges")
        return exchange(*a, **k)

    def kept_counting(*a, **k):
        bump("count_exchanges")
        return kept(*a, **k)

    pipeline.exchange_counts, layer_experts.KeptChoices = exchange_counting, kept_counting
    # Parm's EP&ESP block counts (dropless, padded capacity, trimmed capacity's kept rows);
    # node_dedup's counts (trimmed) or token counts and capacities (padded), gathered inside
    # its exchange
    gathers = [(ep_esp, "count_matrix"),
               (node_dedup_trimmed, "gather_device_counts"), (node_dedup_padded, "gather_known")]
    gathers = {(mod, n): getattr(mod, n) for mod, n in gathers}
    for (mod, name), fn in gathers.items():
        setattr(mod, name, lambda *a, _fn=fn, **k: (bump("count_exchanges"), _fn(*a, **k))[1])
    ex = layer.experts
    if isinstance(ex, FSSDPExperts):
        nxt, add = ex.next_placement, ex.window.add
        ex.next_placement = lambda: (bump("placements"), nxt())[1]
        ex.window.add = lambda loads: (bump("window_adds"), add(loads))[1]
    try:
        yield
    finally:
        hook.remove()
        pipeline.exchange_counts, layer_experts.KeptChoices = exchange, kept
        for (mod, name), fn in gathers.items():
            setattr(mod, name, fn)
        if isinstance(ex, FSSDPExperts):
            del ex.next_placement, ex.window.add


def run(topo: Topology, variant: dict, mode: bool | None) -> list[dict]:
    variant = dict(variant)
    layout = variant.pop("layout", None)
    batch = topo.rank
    if layout is not None:              # Parm: MP ranks hold the same tokens
        mp, ep, esp, in_node = layout
        topo = Topology.from_env(ep_size=ep, local_size=LOCAL, mp_size=mp, esp_size=esp,
                                 esp_in_node=in_node)
        batch = topo.rank // topo.mp_size
    layer = parity.make_layer(CASE, topo, **variant)
    opt = torch.optim.AdamW(layer.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        x, g = fw.batch(CASE, batch, step)
        x.requires_grad_()
        counts: dict = {}
        held: list = []
        if isinstance(layer.experts, FSSDPExperts):      # the forward's held experts
            end = layer.experts.end
            layer.experts.end = lambda back, *a, **k: (
                held.append(weakref.ref(layer.experts._current[1])), end(back, *a, **k))[1]
        with counting(layer, counts):
            layer.prefetch()
            y = layer(x) if mode is None else ckpt.checkpoint(layer, x, use_reentrant=mode)
            if held:                 # bytes the first forward's held experts keep until backward
                flat = held[0]()
                counts["held_bytes"] = 0 if flat is None else flat.untyped_storage().nbytes()
                del flat
            ((y * g).sum() / max(1, y.shape[0])).backward()
        if held:
            del layer.experts.end
        sync_gradients(layer, topo)
        rec = {"y": y.detach(), "x_grad": x.grad, "grads": fw.expert_tensors(layer, True),
               "dense_grads": fw.dense(layer, True), "counts": counts}
        load = getattr(layer.router, "load", None)
        if load is not None:
            rec["loads"] = float(load.sum())
        opt.step()
        opt.zero_grad()
        update_router_biases(layer, topo)
        rec.update(params=fw.expert_tensors(layer, False), dense_params=fw.dense(layer, False))
        if isinstance(layer.experts, FSSDPExperts):
            rec["holders"] = [sorted(h) for h in layer.experts.last_placement.holders]
        steps.append(rec)
    layer.lane.close()
    return steps


def worker(variants: list[str]) -> dict:
    topo = Topology.from_env(local_size=LOCAL)
    return {(v, m): run(topo, VARIANTS[v], MODES[m]) for v in variants for m in MODES}
