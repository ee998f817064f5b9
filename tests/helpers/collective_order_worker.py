"""Rank side of tests/multirank/test_collective_order.py: record every collective a layer call issues.

NCCL requires every rank to issue the operations of one communicator in the same order, and
kernels of different communicators issued from two threads in a rank-dependent order can
deadlock (docs/design.md, "One collective order per rank"). gloo tolerates both, so the CPU
suite would not notice; this recorder makes the order visible. It wraps the
``torch.distributed`` collectives (and the module-level aliases moeflow keeps of them) and
``CommLane.submit``, injects random sleeps (seeded differently per rank) on the lane thread and
on every thread that issues a collective, runs one forward + backward of a float64 layer, and
returns per event: the group's global ranks, the op, the element count that must agree across
the group's ranks (None where it legitimately differs: all-to-all splits, point-to-point), the
issuing thread's name, and whether a communication lane had work in flight at that moment.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from moeflow import Topology
from moeflow.schedule.executor import Timeline
from moeflow.schedule.streams import CommLane
from tests.helpers import parity

#: op -> the argument whose element count every member rank passes alike (None: not compared)
OPS = {
    "all_to_all_single": None,
    "all_reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "output_tensor",
    "all_gather_single": "output_tensor",
    "reduce_scatter": "output",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "broadcast": "tensor",
    "barrier": None,
    "all_gather_object": None,
    "batch_isend_irecv": None,          # isend / irecv travel in it (P2POp checks their
    "send": None,                       # identity, so they are recorded through it)
    "recv": None,
}
P2P = ("batch_isend_irecv", "send", "recv")
LANE_THREAD = "moeflow-comm"          # CommLane's worker thread name prefix

# (layout (mp, ep, esp, esp_in_node) or None for the plain world topology, parity case,
#  MoEConfig overrides, FSSDP holders or None)
R2 = dict(pipeline_degree=2, schedule="optsche")
HOLDERS = [{0, 3}, {0}, {1, 2}, {1}, {2, 0}, {2}, {3, 1}, {3}]   # P' (8 experts, 4 ranks)
CASES = {
    "ep_r2_optsche": (None, "capacity_k2", R2, None),
    "parm_baseline_esp2_r2_optsche": ((1, 2, 2, True), "expert_bias_capacity", R2, None),
    # ESP = MP (Fig. 2): the ESP-AllReduce in forward and the shards' input-gradient
    # all-reduce in backward, both inside task E
    "parm_baseline_esp_is_mp_r2_optsche": ((2, 2, 2, True), "expert_bias_capacity", R2, None),
    "parm_s1_r2": ((2, 1, 2, True), "dropless_k2", dict(parallel_schedule="s1", **R2), None),
    "parm_s2_aas_r2": ((2, 1, 2, True), "dropless_k2",
                       dict(parallel_schedule="s2", parm_saa=False, **R2), None),
    "parm_s2_saa": ((2, 1, 2, True), "expert_bias_capacity",
                    dict(parallel_schedule="s2", pipeline_degree=1), None),
    "fssdp_prefetch_rm_r2": (None, "capacity_k2",
                             dict(placement="fssdp", **R2,
                                  fssdp=dict(materialize="manual", rematerialize=True,
                                             early_gather=True)), HOLDERS),
    # activation recomputation (moeflow/schedule/pipeline.py, "Recomputation"): the layer
    # under torch.utils.checkpoint (its forward rerun in backward), and moe_act
    "ep_r2_optsche_checkpoint": (None, "capacity_k2", R2, None),
    "ep_r2_optsche_checkpoint_reentrant": (None, "capacity_k2", R2, None),
    "ep_r2_optsche_moe_act": (None, "capacity_k2", dict(recompute="moe_act", **R2), None),
    "fssdp_prefetch_rm_r2_moe_act": (None, "capacity_k2",
                                     dict(placement="fssdp", recompute="moe_act", **R2,
                                          fssdp=dict(materialize="manual", rematerialize=True,
                                                     early_gather=True)), HOLDERS),
    "parm_baseline_esp2_r2_checkpoint": ((1, 2, 2, True), "expert_bias_capacity", R2, None),
    "ep_r4_pipelined": (None, "capacity_k2", dict(pipeline_degree=4, schedule="pipelined"),
                        None),
    "ep_r4_pipelined_checkpoint": (None, "capacity_k2",
                                   dict(pipeline_degree=4, schedule="pipelined"), None),
    "parm_s1_r2_checkpoint": ((2, 1, 2, True), "dropless_k2",
                              dict(parallel_schedule="s1", **R2), None),
    "fssdp_prefetch_rm_r2_checkpoint": (None, "capacity_k2",
                                        dict(placement="fssdp", **R2,
                                             fssdp=dict(materialize="manual",
                                                        rematerialize=True,
                                                        early_gather=True)), HOLDERS),
    # a 3-block FSSDP GPT (HECATE-RM, Algorithm 1): the re-gathering spAG launched on the lane
    # under the next block's attention backward (the last layer's at the loss), behind the
    # spRS of the layer after it (overlap_backward)
    "fssdp_gpt_regather_sprs_lane": (None, "gpt", dict(
        placement="fssdp", fssdp=dict(materialize="sparse", overlap_degree=2, memory_capacity=2,
                                      rematerialize=True, overlap_regather=True,
                                      overlap_backward=True)), None),
    # the node-deduplicated exchange (2 nodes x 2), trimmed (its count gather inside the
    # exchange) and padded (its gather of token counts and capacities), plain and checkpointed
    "node_dedup_r2_optsche": (None, "capacity_k2", dict(placement="node_dedup", **R2), None),
    "node_dedup_r2_optsche_checkpoint": (None, "capacity_k2", dict(placement="node_dedup", **R2),
                                         None),
    "node_dedup_r2_optsche_checkpoint_reentrant": (None, "capacity_k2",
                                                   dict(placement="node_dedup", **R2), None),
    "node_dedup_pad_r2": (None, "capacity_k2",
                          dict(placement="node_dedup", capacity_padding="pad", **R2), None),
    "node_dedup_pad_r2_checkpoint_reentrant": (None, "capacity_k2",
                                               dict(placement="node_dedup", capacity_padding="pad",
                                                    **R2), None),
}
# the cases whose layer runs under torch.utils.checkpoint: use_reentrant
CHECKPOINTED = {"node_dedup_r2_optsche_checkpoint": False,
                "node_dedup_r2_optsche_checkpoint_reentrant": True,
                "node_dedup_pad_r2_checkpoint_reentrant": True,
                "ep_r2_optsche_checkpoint": False, "ep_r2_optsche_checkpoint_reentrant": True,
                "parm_baseline_esp2_r2_checkpoint": False, "ep_r4_pipelined_checkpoint": True,
                "fssdp_prefetch_rm_r2_checkpoint": False, "parm_s1_r2_checkpoint": False}


class Recorder:
    def __init__(self, rank: int):
        self.rng = random.Random(9001 + 7919 * rank)      # a different schedule of sleeps
        self.lock = threading.Lock()
        self.in_flight = 0                                # lane tasks submitted, not done
        self.events: list[tuple] = []
        self.on = False

    def sleep(self) -> None:
        with self.lock:
            s = self.rng.uniform(0.0, 0.003)
        time.sleep(s)

    def wrap(self, name: str, fn):
        sig = inspect.signature(fn)
        count_arg = OPS[name]

        def wrapper(*a, **k):
            if not self.on:
                return fn(*a, **k)
            self.sleep()
            bound = sig.bind_partial(*a, **k).arguments
            if name == "batch_isend_irecv":
                group = a[0][0].group if a and a[0] else None
            else:
                group = bound.get("group")
            ranks = tuple(dist.get_process_group_ranks(group if group is not None
                                                       else dist.group.WORLD))
            count = None
            if count_arg is not None:
                t = bound.get(count_arg)
                count = t.numel() if isinstance(t, torch.Tensor) else None
            thread = threading.current_thread().name
            with self.lock:
                busy = self.in_flight > 0
                self.events.append((ranks, name, count, thread, busy))
            return fn(*a, **k)

        return wrapper

    @contextlib.contextmanager
    def patched(self):
        originals = {}
        for name in OPS:
            fn = getattr(dist, name, None)
            if fn is not None and id(fn) not in originals:
                originals[id(fn)] = (name, fn)
        wrappers = {i: self.wrap(n, fn) for i, (n, fn) in originals.items()}
        saved = []
        owners = [dist] + [m for n, m in list(sys.modules.items())
                           if m is not None and n.split(".")[0] == "moeflow"]
        for mod in owners:
            for attr, value in list(vars(mod).items()):
                if id(value) in originals and value is originals[id(value)][1]:
                    saved.append((mod, attr, value))
        submit = CommLane.submit
        rec = self

        def lane_submit(lane, fn, device):
            with rec.lock:
                rec.in_flight += 1

            def task():
                try:
                    rec.sleep()
                    return fn()
                finally:
                    with rec.lock:
                        rec.in_flight -= 1

            return submit(lane, task, device)

        try:
            for owner, attr, fn in saved:
                setattr(owner, attr, wrappers[id(fn)])
            CommLane.submit = lane_submit
            yield self
        finally:
            CommLane.submit = submit
            for owner, attr, fn in saved:
                setattr(owner, attr, fn)


def topology(layout) -> Topology:
    if layout is None:
        return Topology.from_env(local_size=2)
    mp, ep, esp, in_node = layout
    return Topology.from_env(ep_size=ep, local_size=2, mp_size=mp, esp_size=esp,
                             esp_in_node=in_node)


def run_gpt(topo: Topology, overrides: dict) -> list[tuple]:
    """A 3-block MoE GPT in float64: this rank's events of three training steps (the first
    has no load window yet, so Algorithm 1 replicates from the second on)."""
    from moeflow.config import ModelConfig
    from moeflow.models.gpt import GPT

    cfg = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=3, n_heads=2, d_ff=32,
                      moe_every=1, seed=5, moe=dict(num_experts=8, d_expert=12, top_k=2,
                                                    capacity_factor=None, **overrides))
    model = GPT(cfg, topo).double()
    rec = Recorder(topo.rank)
    dist.barrier()
    with rec.patched():
        rec.on = True
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + topo.rank)
            idx = torch.randint(0, 32, (2, 8), generator=gen)
            _, loss = model(idx, torch.randint(0, 32, (2, 8), generator=gen))
            (loss + model.aux_loss).backward()
        rec.on = False
    for layer in model.moe_layers():
        layer.lane.close()
    dist.barrier()
    return rec.events


def run_case(key: str) -> tuple[list[tuple], tuple, list[tuple]]:
    """This rank's events of two forward + backward steps, its ESP group's global ranks
    (empty without ESP), and for the node_dedup cases the steps' task records ``(kind,
    chunk, phase, lane, start, end)`` (empty for the others)."""
    layout, name, overrides, holders = CASES[key]
    topo = topology(layout)
    if name == "gpt":
        return run_gpt(topo, overrides), (), []
    layer = parity.make_layer(name, topo, **overrides)
    if key.startswith("node_dedup"):
        layer.timeline = Timeline()
    if holders is not None:
        layer.experts.set_holders(holders)
    batch = topo.rank // topo.mp_size          # MP ranks hold the same tokens
    x, g = parity.make_batch(name, batch)
    x.requires_grad_()
    rec = Recorder(topo.rank)
    dist.barrier()
    with rec.patched():
        rec.on = True
        for _ in range(2):                     # two steps: each step's order, and across them
            layer.prefetch()                   # HECATE FSSDP's early spAG; no-op otherwise
            if key in CHECKPOINTED:
                y = torch.utils.checkpoint.checkpoint(layer, x,
                                                      use_reentrant=CHECKPOINTED[key])
            else:
                y = layer(x)
            parity.local_loss(y, g, layer).backward()
        rec.on = False
    layer.lane.close()
    dist.barrier()
    esp = (tuple(dist.get_process_group_ranks(topo.esp_group)) if topo.esp_size > 1 else ())
    tasks = [(rec.task.kind, rec.task.chunk, rec.phase, rec.lane, rec.start, rec.end)
             for rec in layer.timeline.records] if layer.timeline is not None else []
    return rec.events, esp, tasks


def worker(keys: list[str]) -> dict:
    out: dict = {"esp_group": {}, "tasks": {}}
    for key in keys:
        out[key], out["esp_group"][key], out["tasks"][key] = run_case(key)
    return out
