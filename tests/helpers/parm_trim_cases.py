"""Rank worker of tests/multirank/test_parm_trim.py: Parm's schedules with
``capacity_padding="trim"`` (only the kept rows sent; beyond the Parm paper,
``moeflow/strategies/parm/padding.py``) beside ``"pad"`` on the same weights and batches, on the
4-rank layouts of ``tests/helpers/parm_cases.py``, in float64: outputs, aux loss, input and
parameter gradients, the layer's stats and each rank's kept rows per expert."""

from __future__ import annotations

from tests.helpers import parity
from tests.helpers.parm_cases import LAYOUTS, batch_index, topology

#: the schedules that trim (the baseline: whole experts only, the MP-drop layout)
VARIANTS = {"ted": dict(parallel_schedule="ted", parm_check_plan=True),
            "ted_r2": dict(parallel_schedule="ted", parm_check_plan=True, pipeline_degree=2,
                           schedule="pipelined"),
            "s1": dict(parallel_schedule="s1")}
BASELINE_LAYOUTS = ("mp2_ep2",)
#: drops (f = 0.5, top-1), a hot expert (the others get few or no rows), expert biases (an
#: empty slot's output is the bias, never combined)
CASES = ("capacity_k1_tight", "hot_expert_capacity", "expert_bias_capacity")


def run(name: str, topo, padding: str, **overrides) -> dict:
    """One forward + backward of ``name`` with ``capacity_padding=padding``."""
    layer = parity.make_layer(name, topo, capacity_padding=padding, **overrides)
    kept = []
    exchange = layer.strategy.exchange

    def spy(send, runner, tokens, call):          # the plan's kept rows per expert
        counts = call.plan.host_counts
        kept.append(None if counts is None else counts.copy())
        return exchange(send, runner, tokens, call)

    layer.strategy.exchange = spy
    x, g = parity.make_batch(name, batch_index(topo.rank, topo.mp_size))
    x.requires_grad_()
    y = layer(x)
    parity.local_loss(y, g, layer).backward()
    out = {"y": y.detach(), "x_grad": x.grad, "aux": layer.aux_loss.detach(),
           "grads": {n: p.grad.detach().clone() for n, p in layer.named_parameters()},
           "stats": layer.stats, "kept": kept[0], "tokens": x.shape[0],
           "top_k": layer.cfg.top_k}
    layer.lane.close()
    return out


def rank_worker() -> dict:
    out = {}
    for layout in LAYOUTS:
        topo = topology(layout)
        variants = dict(VARIANTS)
        if layout in BASELINE_LAYOUTS:
            variants["baseline"] = dict(parallel_schedule="baseline", parm_check_plan=True)
        for variant, kw in variants.items():
            for name in CASES:
                for padding in ("pad", "trim"):
                    out[(layout, variant, name, padding)] = run(name, topo, padding, **kw)
    # S2 and the baseline with ESP shards keep the capacity layout under "trim"
    topo = topology("mp2_esp2_esp_in_node")
    for variant, kw in {"s2": dict(parallel_schedule="s2", parm_check_plan=True),
                        "baseline": dict(parallel_schedule="baseline")}.items():
        out[("mp2_esp2_esp_in_node", variant, "capacity_k1_tight", "trim")] = run(
            "capacity_k1_tight", topo, "trim", **kw)
    return out
