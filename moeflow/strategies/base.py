"""ExpertStrategy: how a MoE layer places its experts and exchanges tokens with them.

``MoELayer.forward`` reads route -> dispatch -> experts -> combine (docs/design.md,
"Strategies: how experts are placed"). Everything that differs between placements sits behind
this interface: plain expert parallelism with the ScheMoE exchange (ScheMoE Section 3), Parm's
schedules with expert-sharding parallelism (Parm Section III, Fig. 3), HECATE's fully sharded
sparse data parallelism (HECATE Sections 3-4) and the node-deduplicated exchange (DeepEP's
inter-node dispatch; SMILE Section 3.2.3 made token-aware). Routing, BigMac's projections, the
shared experts and the gated combine stay in the layer, orthogonal to the strategy.

A strategy is registered under the name that ``MoEConfig.placement`` gives
(:func:`register_strategy`); one object per layer, built by the layer with itself, which it
reads at call time (``cfg``, ``algo``, ``codec`` and ``scheduler``: the tuner replaces them).
Every hook runs on every rank in the same order, so a strategy must not raise on
data-dependent conditions after :meth:`ExpertStrategy.begin` (its peers would wait in a
collective).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from moeflow.config import AUTO, AUTO_PLACEMENTS
from moeflow.dispatch import DispatchPlan, make_plan, permute
from moeflow.errors import ConfigError
from moeflow.registry import Registry
from moeflow.schedule.pipeline import ScheduledExperts, scheduled_experts


@dataclass
class Call:
    """One forward's decisions. Fresh ones are made by the hooks of the layer's first forward;
    under ``torch.utils.checkpoint`` the recomputation gets the first forward's object back
    (``replay=True``, :mod:`moeflow.plan_record`) and chooses, plans and counts nothing again.

    ``k`` / ``factor``: this call's top-k and capacity factor; ``rows``: the rows the layer was
    given (Parm's S1 gathers back to them); ``sched``: Parm's schedule ("s1" / "s2"; None for
    the others); ``plan``: the dispatch plan, set by :meth:`ExpertStrategy.dispatch`;
    ``state``: what else the strategy must reuse (FSSDP: the materialized placement ``P'``);
    ``checkpointed``: the call runs inside an activation checkpoint (which recomputes it)."""
    k: int
    factor: float | None
    rows: int
    sched: str | None = None
    plan: DispatchPlan | None = None
    state: object = None
    replay: bool = False
    checkpointed: bool = False


@dataclass
class CheckpointEntries:
    """A strategy's part of a checkpoint (:mod:`moeflow.checkpoint`), from
    :meth:`ExpertStrategy.checkpoint_entries`.

    ``tensors``: DCP entries aliasing live tensors (``model/...``, ``optim/...``); ``params``:
    the ids of the parameters they store (checkpointing stores those no other way);
    ``keys``: every ``model/`` key of them on any layout (to refuse another model's
    checkpoint); ``meta``: state saved beside the tensors and restored before them, by
    ``restore(meta)`` with the entries the checkpoint holds (it may hold none)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    params: set[int] = field(default_factory=set)
    keys: set[str] = field(default_factory=set)
    meta: dict[str, torch.Tensor] = field(default_factory=dict)
    restore: Callable[[dict], None] | None = None


class ExpertStrategy:
    """The per-layer hooks, in the order the layer calls them (each runs on every rank):

    ========================  ================================================================
    ``build_experts()``       construction: the layer's expert module (``layer.experts``) and
                              the strategy's own parts
    ``overlap(lane, grad)``   before the forward (``grad=None``, the model's prefetch) or
                              after it (``grad``: a tensor whose gradient starts the
                              backward's communication): early communication on the lane
    ``begin(h, call)``        each forward, before the router: this call's choices (or the
                              recorded ones), token split; returns ``(h, experts)``
    ``dispatch(h, weights,    after the router: the plan into ``call.plan`` (a replay keeps
    expert_ids, cap, call)``  the recorded one) and the send buffer
    ``exchange(send, runner,  the rows to the experts and back, then what ``begin`` held is
    tokens, call)``           released; returns ``(back, shared_y)``
    ``finish(y, aux, call)``  after the combine (and shared experts): Parm S1's MP-AllGather
    ``stats()``               after a fresh forward: the strategy's statistics for
                              ``layer.stats``
    ========================  ================================================================

    The model-level interface (class methods over the model's layers of one strategy, called
    through :mod:`moeflow.strategies.model_hooks` by the model, the trainer and checkpointing):
    ``setup_model`` once the model is built, ``on_step_end`` after each optimizer step,
    ``checkpoint_entries`` and ``metrics`` for the training log.

    Per call, :meth:`trims` (``sched``): whether the layer's plan trims capacity padding with
    this call's schedule (default: the flag ``trims_padding``; Parm answers per schedule).
    Before a fresh training call, where :meth:`wants_measurement` says so, the layer lets
    :meth:`measure_choices` time the strategy's per-call candidates (Parm's measured
    ``auto``); :meth:`choice_record` reports what the strategy chose, for benchmarks.

    Flags (attributes, not hooks): ``trims_padding``, ``supports_trim``,
    ``counts_inter_node_bytes``, ``recomputes_experts``, ``combines_in_exchange``,
    ``tunable_fields``, ``refuses_block_recompute(cfg)``. ``OPTIONS``: the options class of
    ``MoEConfig.fssdp`` for a strategy that takes options (validated by
    :meth:`check_options`), None otherwise. :meth:`check_config` refuses, with the fix, what
    the strategy does not run with (at the layer's construction).

    The defaults are plain expert parallelism; a strategy overrides only what differs.
    """

    name = "ep"
    OPTIONS: type | None = None
    trims_padding = True    # capacity mode may send only the kept rows (capacity_padding)
    # MoEConfig.capacity_padding="trim" is honoured (by the layer's plan or the strategy's own)
    supports_trim = True
    # every inter-node byte of the layer goes through the runner's exchanges, so its count
    # is the layer's (``stats["inter_node_bytes"]``); FSSDP's spAG and Parm's ESP collectives
    # are not counted, so those strategies do not report it
    counts_inter_node_bytes = True
    # the experts can run again in backward from their saved input rows (MoEConfig.recompute,
    # schedule/pipeline.py "Recomputation"); False where they exist only during the forward
    recomputes_experts = True
    # the exchange returns the tokens' gated sums (node_dedup): the layer's combine is skipped
    combines_in_exchange = False
    # the MoEConfig fields the auto-tuner may time for this strategy ("auto")
    tunable_fields = ("a2a", "schedule", "pipeline_degree", "codec")

    def __init__(self, layer) -> None:
        self.layer = layer

    # ---- validation (class level) ------------------------------------------------------
    @classmethod
    def check_options(cls, cfg):
        """``MoEConfig.fssdp`` as this strategy's :attr:`OPTIONS` (coerced), or None."""
        if cls.OPTIONS is None:
            if cfg.fssdp is not None:
                raise ConfigError(
                    f"MoEConfig.fssdp={cfg.fssdp!r} is invalid with placement={cls.name!r}: "
                    "FSSDP options need placement='fssdp'; set it or drop the options")
            return None
        return cls.OPTIONS.coerce(cfg.fssdp)

    @classmethod
    def check_config(cls, cfg, topo) -> None:
        """Raise ConfigError (field, value, fix) for what this strategy cannot run with."""
        return None

    @classmethod
    def refuses_block_recompute(cls, cfg) -> tuple[str, str] | None:
        """Flag: (the setting, why and the fix) where this config cannot run under whole-block
        activation recomputation (``TrainConfig.recompute="full"``,
        ``GPT.checkpoint_blocks``), or None."""
        return None

    # ---- per-layer hooks -----------------------------------------------------------------
    def build_experts(self) -> nn.Module:
        """Whole experts, ``num_experts / ep_size`` per EP rank (an ``EXPERTS`` module)."""
        from moeflow.experts.ffn import EXPERTS
        from moeflow.experts.structure import comm_width, expert_hidden

        layer, cfg, topo = self.layer, self.layer.cfg, self.layer.topo
        return EXPERTS[cfg.expert_module](
            comm_width(cfg), expert_hidden(cfg), topo.ep_rank * layer.num_local,
            layer.num_local, cfg.activation, cfg.seed, cfg.layer_id, bias=cfg.expert_bias,
            shard=(topo.esp_rank, topo.esp_size), reduce=self._expert_reduce(),
            activation_options=cfg.activation_options)

    def _expert_reduce(self):
        """What sums the experts' partial outputs (Parm's ESP shards); None for whole ones."""
        return None

    def overlap(self, lane, grad: torch.Tensor | None = None) -> None:
        return None

    def begin(self, h: torch.Tensor, call: Call):
        return h, self.layer.experts

    def dispatch(self, h: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                 cap: int | None, call: Call) -> torch.Tensor:
        if not call.replay:
            call.plan = self._plan(expert_ids, cap, h.device, call)
            self.layer.share_known_capacity(call, cap)
        return self._permute(h, call.plan, weights)

    def trims(self, sched: str | None) -> bool:
        """Whether this strategy's exchange sends only the kept rows of a capacity plan in a
        call with schedule ``sched`` (the call's ``Call.sched``, None outside Parm's
        schedules), where ``MoEConfig.capacity_padding`` trims (``MoELayer.trims_capacity``).
        The answer must be the same on every rank of the call. Default: :attr:`trims_padding`."""
        return self.trims_padding

    def _plan(self, expert_ids: torch.Tensor, cap: int | None, device: torch.device,
              call: Call) -> DispatchPlan:
        return make_plan(expert_ids, self.layer.cfg.num_experts, cap,
                         trim=cap is not None and self.layer.trims_capacity(call.sched, device))

    def _permute(self, h: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor
                 ) -> torch.Tensor:
        return permute(h, plan)

    def exchange(self, send: torch.Tensor, runner: ScheduledExperts, tokens: torch.Tensor,
                 call: Call):
        if runner.shared is not None:       # task S, beside the all-to-all
            return scheduled_experts(send, call.plan, runner, tokens)
        return scheduled_experts(send, call.plan, runner), None

    def finish(self, y: torch.Tensor, aux_loss: torch.Tensor, call: Call):
        return y, aux_loss

    def stats(self) -> dict[str, float]:
        return {}

    # ---- measured per-call choices --------------------------------------------------------
    def wants_measurement(self) -> bool:
        """Whether :meth:`measure_choices` is to run before this call (the same answer on
        every rank). Default: never."""
        return False

    def measure_choices(self, x: torch.Tensor, top_k, capacity_factor, clock,
                        preserved) -> None:
        """Time the strategy's per-call candidates on the call's input ``x`` and options
        before the call proceeds (collective: every rank, the same collectives in the same
        order). The layer calls it at a fresh training call (training mode, grad enabled,
        outside an activation checkpoint and the auto-tuner) when :meth:`wants_measurement`;
        ``clock``: a :class:`~moeflow.autotune.clock.TuneClock` over
        ``MoEConfig.autotune_budget_s``; ``preserved``: a context manager that puts back what
        the timing must not change (:class:`~moeflow.autotune.settings._Preserved`). While it
        runs, the layer's own calls neither tune nor measure (``layer._tuning``)."""
        return None

    def choice_record(self) -> dict:
        """What the strategy chose for the last call and how (JSON-able, for benchmark
        records); default: nothing."""
        return {}

    # ---- model-level interface (class methods over this strategy's layers) ---------------
    @classmethod
    def setup_model(cls, model: nn.Module, layers: list) -> None:
        """Once, after the model is built and before its optimizer."""
        return None

    @classmethod
    def on_step_end(cls, model: nn.Module, layers: list, optimizer, step: int) -> None:
        """After each optimizer step (``step``: the steps done)."""
        return None

    @classmethod
    def checkpoint_entries(cls, model: nn.Module, layers: list, optimizer,
                           optimizer_state: Callable | None) -> CheckpointEntries | None:
        """What this strategy stores in a checkpoint its own way (None: nothing;
        ``optimizer_state(p)``: ``p``'s optimizer state, created if missing; None when the
        optimizer's state is not stored)."""
        return None

    @classmethod
    def metrics(cls, model: nn.Module, layers: list) -> dict:
        """Training-log metrics of the last step, the same on every rank."""
        return {}


STRATEGIES = Registry("strategy", ExpertStrategy)
register_strategy = STRATEGIES.register


def placements(cfg) -> tuple[str, ...]:
    """The registry names a layer of ``cfg`` may run with: ``cfg.placement``, or each of
    ``AUTO_PLACEMENTS`` for ``placement="auto"`` (the auto-tuner chooses among them)."""
    return AUTO_PLACEMENTS if cfg.placement == AUTO else (cfg.placement,)
