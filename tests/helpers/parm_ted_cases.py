"""Rank worker of tests/multirank/test_parm_ted.py: the ``ted`` schedule (DeepSpeed-TED's order
with the node-once exchange, ``moeflow/strategies/parm/ted.py``) on the 4-rank layouts of
``tests/helpers/parm_cases.py``, in float64, and the collectives one forward + backward issues
(the tracer of ``benchmarks.deepspeed.parm_deepspeed_trace``)."""

from __future__ import annotations

import torch

from moeflow.config import ConfigError, MoEConfig
from moeflow.layer import MoELayer
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.strategies.parm.fits import ParmFits
from tests.helpers import parity
from tests.helpers.parm_cases import CASES, LAYOUTS, batch_index, run_rank, topology
from tests.helpers.parm_volume_worker import traced_step

TED = dict(parallel_schedule="ted", parm_check_plan=True)
#: the pipelined ted (beyond the paper, moeflow/strategies/parm/ted_pipelined.py): 2 chunks
#: overlapped, and 3 chunks one after the other
TED_PIPELINED = {"pipelined_r2": dict(TED, pipeline_degree=2, schedule="pipelined"),
                 "sequential_r3": dict(TED, pipeline_degree=3, schedule="sequential")}
#: the cases each runs (the sequential chunks: two of them)
PIPELINED_CASES = {"pipelined_r2": ("capacity_k2", "dropless_k2", "expert_bias_swiglu_dropless",
                                    "expert_bias_capacity", "shared_gated_capacity"),
                   "sequential_r3": ("capacity_k2", "dropless_k2")}
#: the node-once exchange takes no chunks: the chunked case runs unchunked
TED_CASES = {name: {k: v for k, v in kw.items() if k != "pipeline_degree"}
             for name, kw in CASES.items()}


def trace(layout: str, **kw) -> tuple[list[dict], float]:
    """Float collectives of one forward + backward (16 tokens, M = 8, E = 4, top-2, f = 2),
    and the layer's ``stats["parm_inter_node_bytes"]``; ``kw``: more MoEConfig fields."""
    topo = topology(layout)
    cfg = MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, capacity_factor=2.0,
                    parallel_schedule="ted", seed=1, capacity_padding="pad", **kw)
    layer = MoELayer(cfg, topo)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4000 + topo.dp_rank))
    log = traced_step(layer, x.requires_grad_())
    floats = [c for c in log if not str(c["dtype"]).startswith("int")]
    return floats, float(layer.stats["parm_inter_node_bytes"])


def refusal(**kw) -> str:
    try:
        MoELayer(MoEConfig(d_model=8, d_expert=16, num_experts=4, parallel_schedule="ted",
                           **kw), topology("mp2_ep2"))
    except ConfigError as e:
        return str(e)
    return ""


def auto_takes_ted(layout: str, pipelined: bool = False) -> tuple[str, torch.Tensor]:
    """``auto`` with synthetic fits that make the ted schedule the cheapest: the schedule
    taken and the output. ``pipelined``: bandwidth-bound EP and ESP collectives of comparable
    times, where the model has the pipelined ted in 4 chunks win on the layouts with both
    groups, (1,2,2) (with one of them of one rank, chunks only add latencies); otherwise
    latency-bound ones, where chunks only add latencies."""
    cheap, dear = AlphaBeta(1e-6, 1e-12), AlphaBeta(1e-3, 1e-6)
    topo = topology(layout)
    layer = parity.make_layer("capacity_k2", topo, parallel_schedule="auto",
                              parm_auto_measure=False)      # Algorithm 1 alone
    ted = AlphaBeta(1e-9, 1e-8) if pipelined else cheap
    layer.strategy.parts.auto.fits = ParmFits(dear, dear, dear, a2a_ep=ted, ag_esp=ted,
                                              rs_esp=ted)
    x, _ = parity.make_batch("capacity_k2", batch_index(topo.rank, topo.mp_size))
    y = layer(x)
    return layer.strategy.parts.auto.last.schedule, y.detach()


def rank_worker() -> dict:
    out = {}
    for layout in LAYOUTS:
        topo = topology(layout)
        for name, kw in TED_CASES.items():
            out[(layout, name)] = run_rank(name, topo, **{**kw, **TED})
        for variant, names in PIPELINED_CASES.items():
            for name in names:
                out[(layout, variant, name)] = run_rank(
                    name, topo, **{**TED_CASES[name], **TED_PIPELINED[variant]})
        out[(layout, "trace")] = trace(layout)
        out[(layout, "auto")] = auto_takes_ted(layout)
        out[(layout, "auto_pipelined")] = auto_takes_ted(layout, pipelined=True)
    out[("ep2_esp2_esp_in_node", "trace_pipelined")] = trace(
        "ep2_esp2_esp_in_node", pipeline_degree=2, schedule="pipelined")
    out["refusal"] = refusal(codec="bf16")
    out["refusal_optsche"] = refusal(pipeline_degree=2, schedule="optsche")
    return out
