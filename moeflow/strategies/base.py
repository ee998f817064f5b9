"""ExpertStrategy: how a MoE layer places its experts and exchanges tokens with them.

``MoELayer.forward`` reads route -> strategy -> combine (docs/design.md, "Strategies: how
experts are placed"). Everything that differs between placements sits behind this interface:
plain expert parallelism with the ScheMoE exchange (ScheMoE Section 3), Parm's schedules with
expert-sharding parallelism (Parm Section III, Fig. 3), and HECATE's fully sharded sparse data
parallelism (HECATE Sections 3-4). Routing, BigMac's projections, the shared experts and the
combine stay in the layer, orthogonal to the strategy.

A strategy is a plain object bound to its layer; it reads the layer's current ``cfg``,
``algo``, ``codec`` and ``scheduler`` at call time (the tuner replaces them). Every hook runs
on every rank in the same order, so a strategy must not raise on data-dependent conditions
after :meth:`prepare` (its peers would wait in a collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.dispatch import DispatchPlan, combine, make_plan, permute
from moeflow.schedule.pipeline import ScheduledExperts, scheduled_experts


@dataclass
class Call:
    """One forward's state, returned by :meth:`ExpertStrategy.prepare`: the schedule chosen
    for this call (Parm's "s1" / "s2"; None for the others) and the rows the layer was given
    (S1 gathers back to them)."""
    sched: str | None
    rows: int


class ExpertStrategy:
    """The placement hooks, in the order ``MoELayer.forward`` calls them:

    ``prepare(h, k, factor) -> (h, call)``: per-call choice and any token split before the
    gate; ``experts()``: the expert module the exchange runs (FSSDP: its gathered copy);
    ``plan(expert_ids, cap, device, call)``: the dispatch plan; ``exchange(send, plan, runner,
    tokens, call) -> (back, shared_y)``: rows out to the experts and back (``shared_y`` None
    when the shared experts did not run inside it); ``end(back)``: release what
    ``experts()`` held; ``finish(y, aux_loss, call) -> (y, aux_loss)``: after the combine;
    ``prefetch(lane)``, ``regather_on_grad(t, lane)``: optional early communication (in the
    forward; in the backward, from ``t``'s gradient on); ``stats()``: extra statistics.

    Under ``torch.utils.checkpoint`` (:mod:`moeflow.plan_record`) the first forward's
    ``record_state()`` is kept, and the recomputation calls ``prepare`` with the first
    forward's ``call``, then ``replay_experts(state)`` and ``replay_plan(plan, state)`` instead
    of ``experts()`` and ``plan(...)``: nothing is chosen or counted again. ``end`` is told
    whether the call runs under a checkpoint (which recomputes, so nothing is re-gathered).

    The defaults are plain expert parallelism; a strategy overrides only what differs.
    """

    name = "ep"
    trims_padding = True    # capacity mode may send only the kept rows (capacity_padding)
    # every inter-node byte of the layer goes through the runner's exchanges, so its count
    # is the layer's (``stats["inter_node_bytes"]``); FSSDP's spAG and Parm's ESP collectives
    # are not counted, so those strategies do not report it
    counts_inter_node_bytes = True
    # the experts can run again in backward from their saved input rows (MoEConfig.recompute,
    # schedule/pipeline.py "Recomputation"); False where they exist only during the forward
    recomputes_experts = True

    def __init__(self, layer) -> None:
        self.layer = layer

    def prepare(self, h: torch.Tensor, k: int, factor: float | None,
                call: Call | None = None) -> tuple[torch.Tensor, Call]:
        """``call``: the first forward's, in a recomputation (reused, not chosen again)."""
        return h, (Call(None, h.shape[0]) if call is None else call)

    def experts(self):
        return self.layer.experts

    def record_state(self):
        """What a checkpoint's recomputation must reuse besides the plan (None here)."""
        return None

    def replay_experts(self, state):
        """The experts of a recomputation (``state``: :meth:`record_state`'s)."""
        return self.experts()

    def replay_plan(self, plan: DispatchPlan, state) -> DispatchPlan:
        """A recomputation's plan: the first forward's, its count matrix already exchanged."""
        return plan

    def plan(self, expert_ids: torch.Tensor, cap: int | None, device: torch.device,
             call: Call) -> DispatchPlan:
        layer = self.layer
        return make_plan(expert_ids, layer.cfg.num_experts, cap,
                         trim=cap is not None and layer._trims(call.sched, device))

    def permute(self, h: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor
                ) -> torch.Tensor:
        """The send buffer from the tokens (``weights``: the routing's gates, for a strategy
        whose exchange combines)."""
        return permute(h, plan)

    def combine(self, back: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor
                ) -> torch.Tensor:
        """The tokens' outputs from the returned rows: gated sum per token."""
        return combine(back, plan, weights)

    def exchange(self, send: torch.Tensor, plan: DispatchPlan, runner: ScheduledExperts,
                 tokens: torch.Tensor, call: Call):
        if runner.shared is not None:       # task S, beside the all-to-all
            return scheduled_experts(send, plan, runner, tokens)
        return scheduled_experts(send, plan, runner), None

    def end(self, back: torch.Tensor, checkpointed: bool = False) -> torch.Tensor:
        return back

    def finish(self, y: torch.Tensor, aux_loss: torch.Tensor, call: Call):
        return y, aux_loss

    def prefetch(self, lane) -> None:
        return None

    def regather_on_grad(self, t: torch.Tensor, lane) -> None:
        """Optional: start the backward's communication when ``t``'s gradient is computed."""
        return None

    def stats(self) -> dict[str, float]:
        return {}
