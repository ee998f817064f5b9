"""Rank worker of tests/multirank/test_simulate_parm.py: every collective one forward + backward of
a Parm layer issues (baseline, S1, S2 with SAA and with AAS; five layouts of 4 ranks as 2 x 2;
capacity and dropless), with the expert ids its router picked, for the simulator to reproduce.

The tracer wraps the ``torch.distributed`` calls moeflow's Parm code makes, and its own
module-level aliases of them (``_all_gather = dist.all_gather_single``), recording per call the
op, the group's global ranks and the elements this rank puts in (the input tensor: padded as
the library pads); ``batch_isend_irecv`` records each send (SAA's phases)."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

from moeflow.config import MoEConfig
from moeflow.layer import MoELayer
from moeflow.topology import Topology

TOKENS, M, E = 15, 8, 4        # 15 tokens: S1's MP parts differ (7 and 8), so padding shows
LAYOUTS = {                    # name -> (N_MP, N_EP, N_ESP, esp_in_node)
    "2,2,2": (2, 2, 2, True),
    "2,1,2": (2, 1, 2, True),
    "2,2,1": (2, 2, 1, True),
    "1,2,2": (1, 2, 2, True),
    "2,2,2-ep-in-node": (2, 2, 2, False),
}
SCHEDULES = ("baseline", "s1", "s2", "s2-aas")
FACTORS = (2.0, None)          # capacity (padded buffers) and dropless (the router's counts)
_OPS = {"all_to_all_single": 1, "all_gather_into_tensor": 1, "all_gather_single": 1,
        "reduce_scatter_tensor": 1, "reduce_scatter_single": 1, "all_reduce": 0}
_NAME = {"all_to_all_single": "all_to_all", "all_gather_into_tensor": "all_gather",
         "all_gather_single": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "reduce_scatter_single": "reduce_scatter", "all_reduce": "all_reduce"}


def _ranks(group) -> list[int]:
    return list(range(dist.get_world_size())) if group is None else \
        dist.get_process_group_ranks(group)


@contextlib.contextmanager
def traced(log: list, phase: list):
    originals = {id(getattr(dist, n)): (n, getattr(dist, n)) for n in _OPS if hasattr(dist, n)}

    def wrap(name, fn):
        def call(*a, **k):
            group = k.get("group", a[1] if name == "all_reduce" and len(a) > 2 else None)
            x = a[_OPS[name]]
            log.append({"phase": phase[0], "op": _NAME[name], "ranks": _ranks(group),
                        "elements": x.numel(), "dtype": str(x.dtype).replace("torch.", "")})
            return fn(*a, **k)
        return call

    batch = dist.batch_isend_irecv

    def batched(ops):
        for op in ops:
            if op.op is dist.isend:
                log.append({"phase": phase[0], "op": "p2p", "ranks": [dist.get_rank(), op.peer],
                            "elements": op.tensor.numel(),
                            "dtype": str(op.tensor.dtype).replace("torch.", "")})
        return batch(ops)

    wrappers = {i: wrap(n, fn) for i, (n, fn) in originals.items()}
    saved = []
    owners = [dist] + [m for n, m in list(sys.modules.items())
                       if m is not None and n.split(".")[0] == "moeflow"]
    for mod in owners:
        for attr, value in list(vars(mod).items()):
            if id(value) in originals and value is originals[id(value)][1]:
                saved.append((mod, attr, value))
            elif value is batch:
                saved.append((mod, attr, value))
    try:
        for mod, attr, fn in saved:
            setattr(mod, attr, batched if fn is batch else wrappers[id(fn)])
        yield
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


def run(layout: str, schedule: str, factor) -> dict:
    mp, ep, esp, in_node = LAYOUTS[layout]
    topo = Topology.from_env(ep_size=ep, local_size=2, mp_size=mp, esp_size=esp,
                             esp_in_node=in_node)
    cfg = MoEConfig(d_model=M, d_expert=2 * M, num_experts=E, top_k=2, capacity_factor=factor,
                    parallel_schedule=schedule.split("-")[0], parm_saa=schedule != "s2-aas",
                    seed=1, capacity_padding="pad")       # the simulator models the padding
    layer = MoELayer(cfg, topo)
    gen = torch.Generator().manual_seed(4000 + topo.dp_rank)      # MP: the same tokens
    x = torch.randn(TOKENS, M, generator=gen).requires_grad_()
    got = {}

    def keep_ids(_module, _inp, out) -> None:      # returns None: the output is unchanged
        got.setdefault("ids", out.experts)

    layer.router.register_forward_hook(keep_ids)
    log, phase = [], ["forward"]
    dist.barrier()
    with traced(log, phase):
        y = layer(x)
        phase[0] = "backward"
        (y.square().mean() + layer.aux_loss).backward()
    layer.lane.close()
    return {"log": log, "ids": got["ids"].tolist()}


def worker() -> dict:
    return {(layout, schedule, factor): run(layout, schedule, factor)
            for layout in LAYOUTS for schedule in SCHEDULES for factor in FACTORS}
