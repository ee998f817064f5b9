"""Float64 cases for ``parallel_schedule="auto"`` confirmed by measurement
(``MoEConfig.parm_auto_measure``, moeflow/strategies/parm/measured_choice.py; beyond the Parm
paper), importable by spawned ranks: on 4 ranks at (N_MP, N_EP, N_ESP) = (2, 1, 2), the
measured layer's choice, output and gradients against the chosen schedule's fixed layer, and
what the confirmation left of the layer's state."""

from __future__ import annotations

import torch

from moeflow.measure.linkmodel import AlphaBeta
from moeflow.strategies.parm.fits import ParmFits
from moeflow.strategies.parm.measured_choice import predicted_order
from moeflow.strategies.parm.ted_pipelined import pipelined_chunks
from tests.helpers import parity
from tests.helpers.parm_cases import batch_index, topology

LAYOUT = "mp2_esp2_esp_in_node"
CASE = "capacity_k2"
#: synthetic fits weighing every candidate (S1, S2, ted and the pipelined ted), so that the
#: confirmation has five to time; no fits are measured
FITS = ParmFits(AlphaBeta(1e-4, 1e-9), AlphaBeta(2e-4, 1e-9), AlphaBeta(3e-4, 1e-9),
                a2a_ep=AlphaBeta(1e-4, 2e-9), ag_esp=AlphaBeta(1e-4, 2e-9),
                rs_esp=AlphaBeta(1e-4, 2e-9))
GRAD0 = 0.5          # the gradients the caller holds before the confirming call


def fixed_overrides(schedule: str) -> dict:
    """The config of a fixed layer running ``schedule`` as auto runs it (the pipelined ted:
    the ted schedule in that many pipelined chunks)."""
    chunks = pipelined_chunks(schedule)
    if chunks is None:
        return dict(parallel_schedule=schedule)
    return dict(parallel_schedule="ted", pipeline_degree=chunks, schedule="pipelined")


def _state(layer) -> dict:
    return {"grads": {n: None if p.grad is None else p.grad.clone()
                      for n, p in layer.named_parameters()},
            "rng": torch.get_rng_state(), "stats": dict(layer.stats),
            "aux": layer.aux_loss, "timer": layer.timer, "timeline": layer.timeline,
            "strategy_stats": layer.strategy.stats(), "kept": layer.strategy.parts.auto.kept,
            "last": layer.strategy.parts.auto.last}


def _same_state(a: dict, b: dict) -> bool:
    return (a["grads"].keys() == b["grads"].keys()
            and all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])
            and torch.equal(a["rng"], b["rng"]) and a["stats"] == b["stats"]
            and a["aux"] is b["aux"] and a["timer"] is b["timer"]
            and a["timeline"] is b["timeline"] and a["strategy_stats"] == b["strategy_stats"]
            and a["kept"] == b["kept"] and a["last"] is b["last"])


def measured_run(topo, budget_s: float | None) -> dict:
    """A no-grad first call (Algorithm 1 alone), then the first training call (confirmed),
    its state checked around the confirmation, then the chosen schedule's fixed layer on the
    same batch for comparison."""
    layer = parity.make_layer(CASE, topo, parallel_schedule="auto", autotune_budget_s=budget_s)
    auto = layer.strategy.parts.auto
    auto.fits = FITS
    x, g = parity.make_batch(CASE, batch_index(topo.rank, topo.mp_size))
    with torch.no_grad():
        layer(x)
    out = {"no_grad_measured": dict(auto.measured), "no_grad_choice": auto.choice}
    for p in layer.parameters():
        p.grad = torch.full_like(p, GRAD0)
    around = {}
    measure = layer.strategy.measure_choices

    def checked(*args):
        around["before"] = _state(layer)
        measure(*args)
        around["after"] = _state(layer)

    layer.strategy.measure_choices = checked
    xa = x.clone().requires_grad_()
    y = layer(xa)
    parity.local_loss(y, g, layer).backward()
    out.update(choice=auto.choice, algorithm1=auto.last.schedule, order=predicted_order(
        auto.last), measured=dict(auto.measured), cut=list(auto.confirm_cut),
        untouched=_same_state(around["before"], around["after"]),
        record=layer.strategy.choice_record())
    fixed = parity.make_layer(CASE, topo, **fixed_overrides(auto.choice))
    xb = x.clone().requires_grad_()
    yb = fixed(xb)
    parity.local_loss(yb, g, fixed).backward()
    grads = dict(fixed.named_parameters())
    out["y_diff"] = (y - yb).abs().max().item()
    out["x_grad_diff"] = (xa.grad - xb.grad).abs().max().item()
    out["grad_diff"] = max((p.grad - GRAD0 - grads[n].grad).abs().max().item()
                           for n, p in layer.named_parameters())
    layer(x)                                      # a later call: no second confirmation
    out["measured_after"] = dict(auto.measured)
    return out


def rank_worker() -> dict:
    topo = topology(LAYOUT)
    return {"unbounded": measured_run(topo, None), "tight": measured_run(topo, 1e-9)}
