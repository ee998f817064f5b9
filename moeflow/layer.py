"""MoELayer: route -> dispatch -> experts -> combine, as named stages.

The steps of docs/design.md, "The path of a token through MoELayer"; each part is chosen by
name in ``MoEConfig`` from its registry (router, codec, all-to-all algorithm, strategy), so
later parts plug in without changing this file. How experts are placed and reached (plain EP
with the ScheMoE exchange, Parm's schedules, HECATE's FSSDP, the node-deduplicated exchange)
is the ``ExpertStrategy`` that ``MoEConfig.placement`` names (``moeflow/strategies/``,
docs/design.md "Strategies: how experts are placed"); BigMac's projections, the router, the
gated combine and the shared experts wrap it here.
"""

from __future__ import annotations


import torch
from torch import nn

from moeflow.comm.alltoall import ALLTOALLS
from moeflow.comm.codecs import CODECS
from moeflow.config import FROM_CONFIG, ConfigError, MoEConfig
from moeflow.devices import check_not_capturing
from moeflow.dispatch import capacity, combine
from moeflow.dispatch.plan import KnownCapacities, padding_trimmed
from moeflow.experts.shared import SharedExperts
from moeflow.experts.structure import build_projections
from moeflow.layer_call import LayerCall
from moeflow.schedule.phase_timer import NULL_TIMER, PhaseTimer
from moeflow.routing import ROUTERS
from moeflow.routing.aux_grad import attach_aux_loss
from moeflow import autotune, plan_record
from moeflow.schedule import SCHEDULERS
from moeflow.schedule.executor import CommLane, Timeline
from moeflow.schedule.pipeline import ScheduledExperts
from moeflow.schedule.tasks import check_order
from moeflow.strategies import Call, ExpertStrategy, strategy_for
from moeflow.topology import Topology


class MoELayer(nn.Module):
    """A Mixture-of-Experts FFN: ``y = sum_j g_j(x) E_{e_j(x)}(x)`` over the top-k experts
    (BigMac: ``y = (sum_j g_j(x) E_{e_j(x)}(x W_d)) W_u``, see ``experts/structure.py``).

    ``x: (..., d_model) -> (..., d_model)``. After each forward, ``aux_loss`` holds the router's
    scaled auxiliary loss (add it to the training loss), and ``stats`` / ``stat_tensors`` the
    unscaled terms and the fraction of routing choices dropped by capacity (``stat_tensors``
    keeps the losses as detached tensors, so that the forward does not wait for the device;
    ``stats`` converts them to floats, which on a GPU waits for the layer's work). With a
    codec that cannot carry inf/NaN (int8, fp8, zfp), ``nonfinite_payload`` counts the
    non-finite values it was handed in this step's exchanges (forward, then backward).
    With ``attach_aux_loss=True`` the aux loss is instead back-propagated through the output
    (also under reentrant checkpointing) and ``aux_loss`` is detached: log it, do not add it.

    Host synchronisations: none in capacity mode; dropless learns the row counts (one).
    """

    def __init__(self, cfg: MoEConfig, topo: Topology | None = None, *,
                 attach_aux_loss: bool = False):
        super().__init__()
        # attach_aux_loss=True delivers aux_loss through the output's backward
        # (moeflow/routing/aux_grad.py; works under any activation checkpointing); the
        # caller then must not add it (aux_loss keeps only the detached value)
        if not isinstance(attach_aux_loss, bool):
            raise ConfigError(f"MoELayer attach_aux_loss={attach_aux_loss!r} is invalid: must "
                              "be True (aux loss back-propagated through the output) or False "
                              "(add layer.aux_loss to the loss yourself)")
        self.attach_aux_loss = attach_aux_loss
        self.aux_loss_backward_scale = 1.0     # d(your loss)/d(aux_loss) when attached
        topo = topo or Topology.single()
        # "auto" a2a / schedule / pipeline_degree run as direct / sequential / 1
        # until the first forward tunes them (moeflow/autotune.py)
        self.requested_cfg = cfg
        self.auto_fields = autotune.auto_fields(cfg)
        self.tuned: autotune.TunedChoice | None = None
        self._tuning = False
        self._rows: int | None = None          # rows sent over the EP group by the last forward
        # training forwards between the collective checks of whether to re-tune
        self.retune_check_every = autotune.RETUNE_CHECK_EVERY
        self._forwards = 0
        # moeflow/strategies/, by MoEConfig.placement ("auto": "ep" until tuned)
        strategy = strategy_for(cfg, topo)
        untunable = [f for f in self.auto_fields if (f not in strategy.tunable_fields
                                                     and f != "placement")
                     or cfg.parallel_schedule != "baseline"]
        if untunable:
            raise ConfigError(
                f"MoEConfig {', '.join(f'{f}={getattr(cfg, f)!r}' for f in untunable)}"
                " cannot be tuned with "
                f"placement={cfg.placement!r} and parallel_schedule={cfg.parallel_schedule!r}: "
                "the tuner times the expert-parallel exchange (FSSDP's load window and Parm's "
                "EP&ESP exchange are not what it measures; node_dedup runs its own hops, no "
                "all-to-all algorithm); set them explicitly (e.g. a2a='direct', "
                "schedule='sequential', pipeline_degree=1, codec='none')")
        cfg = autotune.placeholder(cfg)
        if cfg.num_experts % topo.ep_size:
            raise ConfigError(
                f"MoEConfig.num_experts={cfg.num_experts} is invalid for an expert-parallel size "
                f"of {topo.ep_size}: it must be a multiple of it; use "
                f"{-(-cfg.num_experts // topo.ep_size) * topo.ep_size} experts or a smaller "
                "ep_size")
        self.cfg, self.topo = cfg, topo
        self.num_local = cfg.num_experts // topo.ep_size
        strategy.check_config(cfg, topo)
        ROUTERS[cfg.router].check_topology(cfg, topo)
        self.router = ROUTERS[cfg.router](cfg)
        self.dcca = build_projections(cfg)      # BigMac's W_d / W_u; None for other structures
        self.algo = ALLTOALLS[cfg.a2a](topo)
        self.strategy: ExpertStrategy = strategy(self)
        self.experts = self.strategy.build_experts()
        # shared experts (DeepSeek-V3, Qwen2-MoE): replicated, on this rank's tokens, as task S
        self.shared = SharedExperts(cfg) if cfg.num_shared_experts else None
        self.codec = CODECS[cfg.codec]()
        self.backward_codec = self.codec if cfg.codec_backward else CODECS["none"]()
        self.scheduler = SCHEDULERS[cfg.schedule]()
        self._checked_schedule: tuple | None = None
        self._check_schedule()
        # MoEConfig.equal_rank_tokens: every rank's C_p per call key (dispatch/plan.py)
        self._known_capacities: dict = {}
        self.lane = CommLane()
        self.timer: PhaseTimer | None = None
        self.timeline: Timeline | None = None     # set to a Timeline to record every task
        self.aux_loss: torch.Tensor | None = None
        self._stats: dict[str, torch.Tensor | float] = {}

    def _check_schedule(self) -> None:
        """Validate the scheduler's order at the configured pipelining degree (ScheMoE Eq. 4-9
        dependencies), once per (scheduler, degree): at construction, and again in forward
        after ``cfg`` or ``scheduler`` was replaced (the profiler changes the degree)."""
        key = (self.scheduler, self.cfg.pipeline_degree)
        if self._checked_schedule == key:
            return
        r, s = self.cfg.pipeline_degree, self.scheduler
        where = f"{type(s).__module__}.{type(s).__qualname__}.order({r})"
        try:
            order = list(s.order(r))
            check_order(order, r)
        except (ValueError, TypeError) as e:
            raise ConfigError(
                f"MoEConfig.schedule={self.cfg.schedule!r} is invalid at pipeline_degree={r}: "
                f"{where} must return each computing task (C1, D1, E, C2, D2 of every chunk) "
                f"once, after its same-chunk predecessors: {e}; fix the scheduler's order() or "
                "choose another schedule") from e
        self._checked_schedule = key

    def trims_capacity(self, sched, device: torch.device) -> bool:
        """Whether this call's capacity plan sends only the kept rows
        (``MoEConfig.capacity_padding``): where the strategy trims with the call's schedule
        ``sched`` (:meth:`ExpertStrategy.trims`: plain EP; Parm's ted, pipelined ted, S1 and
        MP-drop baseline; not FSSDP, Parm's S2 or its baseline with ESP shards, which lay out
        capacity themselves) and the mode trims on ``device``
        (:func:`~moeflow.dispatch.plan.padding_trimmed`: "auto" on CPU in eager mode)."""
        return (padding_trimmed(self.cfg.capacity_padding, device)
                and self.strategy.trims(sched))

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the last forward's aux_loss (it belongs to that graph)."""
        state = dict(super().__getstate__())
        state["aux_loss"] = None
        return state

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"structure={c.structure}, experts={c.num_experts} (local {self.num_local}), "
                f"top_k={c.top_k}, "
                f"capacity_factor={c.capacity_factor}, router={c.router}, codec={c.codec}, "
                f"a2a={c.a2a}, schedule={c.schedule}, r={c.pipeline_degree}")

    def tune(self, x: torch.Tensor, reps: int = 2) -> autotune.TunedChoice:
        """Measure and fix the config's ``"auto"`` fields on input ``x`` (collective: every
        rank calls it, as the first forward does); returns the choice, also in ``tuned``."""
        if not self.auto_fields:
            raise ConfigError("MoELayer.tune: this layer's MoEConfig has no 'auto' field "
                              "(a2a, schedule, pipeline_degree, placement; codec "
                              "'auto:lossy'); set one to 'auto' to tune it")
        self.set_tuned(autotune.tune(self, x.reshape(-1, self.cfg.d_model),
                                     self.requested_cfg, reps))
        return self.tuned

    def set_tuned(self, choice: autotune.TunedChoice) -> None:
        """Fix a tuning result (from :meth:`tune`, or a checkpoint) for the auto fields."""
        self.tuned = choice
        autotune.apply(self, autotune.placeholder(self.requested_cfg).replace(
            **{f: getattr(choice, f) for f in self.auto_fields}))

    @property
    def stat_tensors(self) -> dict[str, torch.Tensor | float]:
        """The last forward's statistics, losses as detached tensors (no device sync)."""
        return dict(self._stats)

    @property
    def stats(self) -> dict[str, float]:
        """The last forward's statistics as floats (a device sync on GPU: read when logging)."""
        return {k: float(v) for k, v in self._stats.items()}

    def prefetch(self) -> None:
        """HECATE FSSDP: start this iteration's spAG on the layer's communication lane, so
        that it overlaps what runs before the layer (the GPT block calls it before its
        attention, Fig. 1c). A no-op for other placements or with ``early_gather=False``, and
        inside a checkpoint's recomputation (which gathers the recorded ``P'`` itself)."""
        if plan_record.recomputing():
            return
        self.strategy.overlap(self.lane)

    def regather_on_grad(self, grad_of: torch.Tensor) -> None:
        """HECATE FSSDP with ``fssdp.overlap_regather`` (HECATE-RM, Section 3.2): when the
        backward computes ``grad_of``'s gradient, start this layer's re-gathering spAG (of its last
        forward's freed experts) on the communication lane, so that it overlaps the backward
        between there and this layer's (the GPT passes the next block's attention output, and
        the loss for its last MoE layer). Call it after this layer's forward, once; a no-op for
        other placements, without the option, or when nothing was freed."""
        self.strategy.overlap(self.lane, grad=grad_of)

    def _note_rows(self, plan, training: bool = False) -> None:
        """The tuner's row count: training forwards only (evaluation batches of another size
        must not re-tune; ``training``: a checkpoint's first forward, grad enabled or not)."""
        if (self.auto_fields and not self._tuning and plan.counts is not None
                and (training or torch.is_grad_enabled())):
            self._rows = int(plan.counts.sum())          # the same number on every EP rank
            if self.tuned.rows is None:
                self.tuned.rows = self._rows

    def forward(self, x: torch.Tensor, *, top_k: int | None = None,
                capacity_factor: float | None | str = FROM_CONFIG) -> torch.Tensor:
        """``x: (..., d_model)``. ``top_k`` and ``capacity_factor`` override the config's for
        this call only (no rebuild; ``capacity_factor=None`` is dropless, ``"auto"`` the
        structure's default), as Tutel's ``moe(x, top_k=..., capacity_factor=...)``.

        Under ``torch.utils.checkpoint`` the recomputation replays the first forward's
        decisions (:mod:`moeflow.plan_record`): routing choices, plan and counts, the tuner's
        choice, the strategy's placement; it exchanges no counts."""
        where = plan_record.region()
        record = plan_record.take(where, self)
        if record is None:
            k, factor = self._begin_call(x, top_k, capacity_factor,
                                         training=torch.is_grad_enabled() or where is not None,
                                         checkpointed=where is not None)
            rows = x.numel() // self.cfg.d_model
            return self._forward(x, LayerCall.fresh(rows, k, factor, where))
        saved = self.exchange_settings()
        self._use_settings(record.settings)          # the tuner's choice of that forward
        try:
            return self._forward(x, LayerCall.replayed(record, where))
        finally:
            self._use_settings(saved)

    def exchange_settings(self) -> tuple:
        """(cfg, algo, codec, backward_codec, scheduler, strategy): what the tuner may replace
        (the strategy with ``placement="auto"``)."""
        return (self.cfg, self.algo, self.codec, self.backward_codec, self.scheduler,
                self.strategy)

    def _use_settings(self, settings: tuple) -> None:
        (self.cfg, self.algo, self.codec, self.backward_codec, self.scheduler,
         self.strategy) = settings

    def _forward(self, x: torch.Tensor, this: LayerCall) -> torch.Tensor:
        """One call as named stages: route, dispatch, experts (the strategy's exchange),
        combine. ``this``: the call's decisions, fresh or (a checkpoint's recomputation, HECATE
        Section 3.2 / Megatron-core's MoE recompute) the first forward's, so that nothing the
        first forward planned is planned again. Nothing that depends on this rank's data
        raises after ``begin`` (its peers would wait); pipeline_degree may exceed a rank's
        rows: its chunks are then partly empty."""
        call, strategy = this.call, self.strategy
        tokens, experts = strategy.begin(x.reshape(-1, self.cfg.d_model), call)
        routing = self._stage("route", tokens, lambda h: self._route(h, this))
        hidden = self._project("down", tokens)         # BigMac: descend before dispatch
        cap = (None if call.factor is None
               else capacity(hidden.shape[0], call.k, self.cfg.num_experts, call.factor))
        send = self._stage("permute", hidden, lambda h: strategy.dispatch(
            h, routing.weights, routing.experts, cap, call))
        runner = self._runner(experts, this, hidden)
        this.keep(self, routing, runner)
        back, shared_y = strategy.exchange(self._timer.mark(send, None), runner, tokens, call)
        if self.shared is not None and shared_y is None:   # not overlapped by the strategy
            shared_y = self.shared(tokens)
        if not this.replay:
            self._note_rows(call.plan, training=call.checkpointed)
        y = self._stage("combine", back, lambda b: b if strategy.combines_in_exchange
                        else combine(b, call.plan, routing.weights, tokens.dtype))
        y = self._project("up", y)                     # BigMac: ascend after combine
        if shared_y is not None:                       # DeepSeek-V3 Eq. 12: + sum FFN^(s)
            y = y + shared_y.to(y.dtype)
        y, aux_loss = strategy.finish(y, routing.aux_loss, call)
        if not this.replay:                # a recomputation leaves the forward's results
            self.aux_loss = aux_loss
            self._record_stats(routing, call.plan, runner.nonfinite, runner.inter_node_bytes)
        # the input's dtype (under autocast too, as torchtitan's layer): the gated sum above
        # is in the router's float32; a strategy that sums in its exchange is cast
        y = self._timer.mark(y.to(x.dtype), None).reshape(x.shape)
        if self.attach_aux_loss:        # the aux loss rides on y's backward
            y = attach_aux_loss(y, aux_loss, self.aux_loss_backward_scale)
            if not this.replay:
                self.aux_loss = self.aux_loss.detach()
        return y

    @property
    def _timer(self):
        return self.timer or NULL_TIMER

    def _stage(self, name: str, x: torch.Tensor, run):
        """``run(x)`` timed as the stage ``name`` (forward: its span; backward: from the
        gradient reaching ``x`` on, :class:`~moeflow.schedule.phase_timer.PhaseTimer`)."""
        with self._timer.phase(name, x):
            return run(self._timer.mark(x, name))

    def _route(self, tokens: torch.Tensor, this: LayerCall):
        # routers compute in float32 at least: outside autocast, which would run their matmul
        # (and, on CPU, their softmax) in bf16 and take routing decisions at bf16 precision
        with torch.autocast(tokens.device.type, enabled=False):
            return self.router(tokens, **this.route_options(self))   # reads x (pre-descend)

    def _project(self, direction: str, x: torch.Tensor) -> torch.Tensor:
        """BigMac's down / up projection (``experts/structure.py``); the identity without."""
        if self.dcca is None:
            return x
        return self._stage("project", x, getattr(self.dcca, direction))

    def _runner(self, experts, this: LayerCall, like: torch.Tensor) -> ScheduledExperts:
        """The scheduled exchange with the experts for this call (ScheMoE Section 3.2)."""
        nonfinite, inter_bytes = this.counters(self, like)
        return ScheduledExperts(experts, self.algo, self.codec, self.backward_codec,
                                self.scheduler, self.cfg.pipeline_degree, self.lane,
                                self.timeline or self._timer.timeline, nonfinite, self.shared,
                                inter_bytes, recompute=self.cfg.recompute == "moe_act",
                                # under a checkpoint even FSSDP's experts can rerun in
                                # backward: their held copy stays bound to the call
                                can_recompute=(self.strategy.recomputes_experts
                                               or this.where is not None))

    def share_known_capacity(self, call: Call, cap: int | None) -> None:
        """``MoEConfig.equal_rank_tokens``: every rank's C_p, gathered once per call key
        (dispatch/plan.py), on a fresh plan in capacity mode."""
        if self.cfg.equal_rank_tokens and cap is not None:
            call.plan.known = KnownCapacities(self._known_capacities,
                                              (call.rows, call.k, call.factor), call.rows)

    def _begin_call(self, x: torch.Tensor, top_k, capacity_factor, training: bool = True,
                    checkpointed: bool = False) -> tuple[int, float | None]:
        """Input checks, the tuner's first (or re-) tuning, the strategy's measured choices,
        and this call's (top_k, factor). ``training``: a training forward (grad enabled, or
        the first forward of a checkpoint, which the reentrant one runs without grad), where
        the re-tuning check counts; ``checkpointed``: inside an activation checkpoint."""
        if x.is_cuda:                      # a CUDA graph cannot hold this layer (docs/gpu.md)
            check_not_capturing("MoELayer.forward")
        if not x.is_floating_point():
            raise TypeError(f"MoELayer input has dtype {x.dtype}; it must be floating point "
                            "(token embeddings, e.g. float32 or bfloat16): convert token ids "
                            "with an nn.Embedding first, or cast with x.float()")
        if x.shape[-1] != self.cfg.d_model:
            raise ValueError(f"MoELayer input has last dimension {x.shape[-1]} but "
                             f"MoEConfig.d_model={self.cfg.d_model}; reshape the input or "
                             f"build the layer with d_model={x.shape[-1]}")
        if self.auto_fields and not self._tuning and (self.tuned is None or (
                training and autotune.retune_agreed(self))):
            self.tune(x)                   # collective; every rank decides alike (see autotune)
        self._check_schedule()
        k, factor = self.cfg.per_call(top_k, capacity_factor)
        if k != self.cfg.top_k:
            self.router.check_top_k(self.cfg, k)
        # the strategy's per-call candidates timed on this call (Parm's measured auto): at a
        # training call with gradients, outside a checkpoint (whose forward cannot run the
        # timed backwards) and the tuner; collective, every rank decides alike
        if (not self._tuning and not checkpointed and self.training
                and torch.is_grad_enabled() and self.strategy.wants_measurement()):
            self.strategy.measure_choices(
                x, top_k, capacity_factor,
                autotune.TuneClock(self.cfg.autotune_budget_s, self.topo),
                autotune._Preserved(self))
        return k, factor

    def _record_stats(self, routing, plan, nonfinite, inter_bytes=None) -> None:
        """``stats`` / ``stat_tensors`` of this forward (no device sync)."""
        n_choices = max(1, routing.experts.numel())
        self._stats = {"balance_loss": routing.balance_loss.detach(),
                       "z_loss": routing.z_loss.detach(),
                       "dropped_fraction": plan.dropped / n_choices}
        if self.tuned is not None:
            self._stats["autotune_pipeline_degree"] = float(self.cfg.pipeline_degree)
            for key in ("predicted_ms", "measured_ms", "codec_error"):
                if getattr(self.tuned, key) is not None:
                    self._stats[f"autotune_{key}"] = getattr(self.tuned, key)
            self._stats["autotune_budget_cut"] = float(bool(self.tuned.budget_cut))
            if "placement" in self.auto_fields:      # which strategy the tuner kept
                self._stats["autotune_node_dedup"] = float(self.cfg.placement == "node_dedup")
        self._stats.update(self.strategy.stats())
        if nonfinite is not None:       # forward's count; backward adds its own in place
            self._stats["nonfinite_payload"] = nonfinite
        if inter_bytes is not None:     # bytes this rank sent over inter-node links: the
            self._stats["inter_node_bytes"] = inter_bytes    # forward's, + backward's in place

