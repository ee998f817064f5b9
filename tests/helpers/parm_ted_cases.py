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
#: the node-once exchange takes no chunks: the chunked case runs unchunked
TED_CASES = {name: {k: v for k, v in kw.items() if k != "pipeline_degree"}
             for name, kw in CASES.items()}


def trace(layout: str) -> tuple[list[dict], float]:
    """Float collectives of one forward + backward (16 tokens, M = 8, E = 4, top-2, f = 2),
    and the layer's ``stats["parm_inter_node_bytes"]``."""
    topo = topology(layout)
    cfg = MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, capacity_factor=2.0,
                    parallel_schedule="ted", seed=1)
    layer = MoELayer(cfg, topo)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4000 + topo.dp_rank))
    log = traced_step(layer, x.requires_grad_())
    floats = [c for c in log if not str(c["dtype"]).startswith("int")]
    return floats, float(layer.stats["parm_inter_node_bytes"])


def refusal() -> str:
    try:
        MoELayer(MoEConfig(d_model=8, d_expert=16, num_experts=4, parallel_schedule="ted",
                           codec="bf16"), topology("mp2_ep2"))
    except ConfigError as e:
        return str(e)
    return ""


def auto_takes_ted(layout: str) -> tuple[str, torch.Tensor]:
    """``auto`` with synthetic fits that make the ted schedule the cheapest: the schedule
    taken and the output."""
    cheap, dear = AlphaBeta(1e-6, 1e-12), AlphaBeta(1e-3, 1e-6)
    topo = topology(layout)
    layer = parity.make_layer("capacity_k2", topo, parallel_schedule="auto")
    layer.strategy.parts.auto.fits = ParmFits(dear, dear, dear, a2a_ep=cheap, ag_esp=cheap,
                                              rs_esp=cheap)
    x, _ = parity.make_batch("capacity_k2", batch_index(topo.rank, topo.mp_size))
    y = layer(x)
    return layer.strategy.parts.auto.last.schedule, y.detach()


def rank_worker() -> dict:
    out = {}
    for layout in LAYOUTS:
        topo = topology(layout)
        for name, kw in TED_CASES.items():
            out[(layout, name)] = run_rank(name, topo, **{**kw, **TED})
        out[(layout, "trace")] = trace(layout)
        out[(layout, "auto")] = auto_takes_ted(layout)
    out["refusal"] = refusal()
    return out
