"""``MoEConfig``: the configuration of one MoE layer and its checks.

Every bad value fails at construction with a :class:`ConfigError` whose message names the field,
the value it was given, and how to fix it. Names of routers, codecs and all-to-all algorithms are
checked against the registries, so a user-registered part is accepted once it is registered.
The fields follow the papers of the parts they configure (GShard capacity, ScheMoE Sections 3-5,
BigMac's structures, SMILE's bi-level routing, HECATE Section 3.2, Parm Section III); each field's
comment names its section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeflow.config.validation import _positive_int, _require, config_error
from moeflow.errors import ConfigError
from moeflow.registry import did_you_mean, registry


AUTO = "auto"      # a2a / schedule / pipeline_degree measured on the cluster (ScheMoE 3.2, 4)
AUTO_LOSSY = "auto:lossy"   # the codec measured too, lossy ones within their error budget
# placement="auto": the strategies the tuner measures against each other, the simplest first.
# Both hold the same whole experts on the same ranks (only the exchange differs: ScheMoE's
# all-to-all vs the node-deduplicated one of DeepEP's inter-node dispatch), so the choice
# changes speed only, and a checkpoint of one loads into the other.
AUTO_PLACEMENTS = ("ep", "node_dedup")
DEFAULT_LOSSY_ERROR_BUDGET = 1e-2   # what lossy_error_budget=None means with codec auto:lossy
DEFAULT_AUTOTUNE_BUDGET_S = 30.0    # MoEConfig.autotune_budget_s's default
PARM_SCHEDULES = ("baseline", "s1", "s2", "auto", "ted")   # Parm Fig. 3a/3b/3c, Algorithm 1;
# "ted": DeepSpeed-TED's order with a node-once EP&ESP exchange (strategies/parm/ted.py)


ACTIVATIONS = ("gelu", "swiglu", "relu", "clamped_swiglu")   # built in (the "activation"
# registry, moeflow/experts/activations.py, holds them and user ones); any elementwise F
# function also works
# How f_e of the load-balancing loss counts top-k choices (see moeflow/routing/losses.py):
# all k choices (Megatron-core) or each token's first choice (GShard, DeepSpeed-MoE, Tutel).
BALANCE_LOSSES = ("all_choices", "first_choice")   # = moeflow.routing.losses.BALANCE_LOSSES
# MoE structures (BigMac section "Analysis of Different MoE Structures"); see
# moeflow/experts/structure.py for what each one computes.
STRUCTURES = ("vanilla", "fine_grained", "bigmac")
CAPACITY_PADDINGS = ("auto", "pad", "trim")
MOE_RECOMPUTES = ("none", "moe_act")         # MoEConfig.recompute
DEFAULT_CAPACITY_FACTOR = 1.25        # what capacity_factor="auto" means for "vanilla"
DEFAULT_DOWNSCALE_FACTOR = 0.25       # BigMac's r (paper: 0.25)


def _elementwise_in_F(name) -> bool:
    """Whether ``torch.nn.functional.<name>`` is a deterministic elementwise function of one
    tensor: applied to a (4, 8) tensor it must equal itself applied to the 32 values as a
    column (this refuses reductions such as softmax, shape changes such as glu, functions that
    need more arguments such as threshold, random ones such as dropout, in-place variants)."""
    import warnings

    import torch
    import torch.nn.functional as F

    if (not isinstance(name, str) or name.startswith("_") or name.endswith("_")
            or "dropout" in name):       # identity at training=False: not an activation
        return False
    fn = getattr(F, name, None)
    if not callable(fn) or isinstance(fn, type):
        return False
    t = torch.linspace(-3.0, 2.5, 32, dtype=torch.float64)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = fn(t.reshape(4, 8))
            col = fn(t.reshape(32, 1))
    except Exception:                    # any failure means: not usable as an activation
        return False
    return (isinstance(y, torch.Tensor) and isinstance(col, torch.Tensor)
            and y.shape == (4, 8) and col.shape == (32, 1) and y.is_floating_point()
            and torch.equal(y.reshape(-1), col.reshape(-1)))


def _check_activation(o: str, name) -> None:
    reg = registry("activation")
    if name in reg or _elementwise_in_F(name):
        return
    import difflib

    import torch.nn.functional as F

    names = sorted(set(reg) | {n for n in dir(F) if not n.startswith("_")})
    close = [n for n in difflib.get_close_matches(str(name), names, n=6, cutoff=0.6)
             if n in reg or _elementwise_in_F(n)][:3]
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    known = (f"torch.nn.functional.{name} is not an elementwise function of one tensor; "
             if isinstance(name, str) and hasattr(F, name) else "")
    raise config_error(o, "activation", name,
                       f"{known}choose one of {', '.join(sorted(reg))} (register your own with "
                       "moeflow.register_activation) or the name of an elementwise "
                       f"function of one tensor in torch.nn.functional (e.g. silu, mish, "
                       f"leaky_relu, tanh){hint}")


class _FromConfig:
    """The default of a per-call option of ``MoELayer.forward``: use the config's value."""

    def __repr__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG = _FromConfig()


def _resolve_capacity_factor(structure: str, capacity_factor):
    return (DEFAULT_CAPACITY_FACTOR if structure == "vanilla" else None) \
        if capacity_factor == "auto" else capacity_factor


def _check_structure(o: str, structure, capacity_factor, downscale_factor, d_model: int,
                     d_expert: int):
    """Validate the structure fields; return the resolved capacity factor.

    ``capacity_factor="auto"`` resolves to 1.25 for ``vanilla`` and to None (dropless) for
    ``fine_grained`` and ``bigmac`` (BigMac section "Enabling Dropless Token Routing").
    """
    _require(structure in STRUCTURES, o, "structure", structure,
             f"choose one of {', '.join(STRUCTURES)}{did_you_mean(structure, STRUCTURES)}")
    capacity_factor = _resolve_capacity_factor(structure, capacity_factor)
    if structure != "bigmac":
        _require(downscale_factor is None, o, "downscale_factor", downscale_factor,
                 "only structure='bigmac' descends before the all-to-all; set "
                 "structure='bigmac' or leave downscale_factor unset (None)")
        return capacity_factor
    r = DEFAULT_DOWNSCALE_FACTOR if downscale_factor is None else downscale_factor
    _require(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r <= 1, o,
             "downscale_factor", downscale_factor,
             "must be in (0, 1] (the paper uses 0.25); the communicated width is "
             "downscale_factor * d_model")
    width = r * d_model
    _require(abs(width - round(width)) < 1e-9 and round(width) >= 1, o, "downscale_factor",
             downscale_factor, f"downscale_factor * d_model = {width:g} must be a positive "
             f"integer (d_model={d_model}); pick r so that r * d_model is whole, e.g. "
             f"{_nice_r(d_model)}")
    hidden = d_expert / r
    _require(abs(hidden - round(hidden)) < 1e-9, o, "d_expert", d_expert,
             f"BigMac experts have hidden width d_expert / downscale_factor = {hidden:g}, which "
             f"must be an integer; use a d_expert that is a multiple of {_numerator(r)} or "
             f"another downscale_factor")
    return capacity_factor


def _nice_r(d_model: int) -> str:
    good = [r for r in (0.125, 0.25, 0.5) if (r * d_model).is_integer()]
    return f"{good[0]}" if good else f"1/{d_model} multiples"


def _numerator(r: float) -> int:
    """p of r = p/q in lowest terms: d_expert / r is an integer iff p divides d_expert."""
    from fractions import Fraction
    return Fraction(r).limit_denominator(10**6).numerator


@dataclass
class MoEConfig:
    """One MoE layer.

    ``capacity_factor=None`` means dropless routing (every token reaches its experts, split
    sizes vary and are exchanged first); ``"auto"`` (the default) is 1.25 for the ``vanilla``
    structure and dropless for ``fine_grained`` and ``bigmac``, and is resolved when the config
    is built. ``d_expert`` is the hidden width of each expert FFN (for ``bigmac``, of the
    fine-grained expert it replaces: BigMac experts are ``r*d_model -> d_expert/r ->
    r*d_model``). ``layer_id`` is the layer's global identity: with ``seed`` it fixes every
    initial weight, independently of how many ranks share the experts.

    ``structure`` (BigMac, Fig. 2): ``vanilla`` few large experts, ``fine_grained`` many small
    ones (both communicate at ``d_model``), ``bigmac`` descend to ``downscale_factor *
    d_model`` before the all-to-all and ascend after it (default ``downscale_factor`` 0.25).

    ``activation`` is ``gelu``, ``relu``, ``swiglu`` or the name of any elementwise function
    of ``torch.nn.functional`` (``silu``, ``mish``, ``leaky_relu``, ...); ``expert_bias`` adds
    biases to the expert projections (Tutel's ``has_fc1_bias`` / ``has_fc2_bias``).

    ``balance_loss`` chooses how the load-balancing loss ``E sum_e f_e P_e`` counts top-k
    choices in ``f_e``: ``"all_choices"`` (Megatron-core) or ``"first_choice"`` (GShard,
    DeepSpeed-MoE, Tutel); see ``moeflow/routing/losses.py``. With ``router="bilevel"`` it
    applies per level of SMILE's Eq. (4), whose ``f`` is the first choice (argmax).

    ``parallel_schedule`` orders Parm's MP+EP+ESP communication (``moeflow/strategies/parm``,
    used when the topology has ``mp_size`` or ``esp_size`` > 1): ``"baseline"`` is
    DeepSpeed-MoE's order (Parm Fig. 3a); ``"s1"`` pauses MP before the gate (Fig. 3b),
    ``"s2"`` after it (Fig. 3c), both with the EP&ESP-AlltoAll; ``"ted"`` (beyond the paper)
    drops the MP duplicates and sends each row once to its expert's EP rank, fanned out to the
    ESP shards inside their group (DeepSpeed-TED's order, ``strategies/parm/ted.py``); ``"auto"``
    picks S1 or S2 per call by Algorithm 1, or ted where its fits are measured; with
    ``parm_auto_measure`` (default) its candidates are first timed on the layer's first
    training call and only the measured ones weighed (beyond the paper). ``parm_saa`` runs S2's
    second all-to-all and MP-AllGather at once (SAA, Section III-D; ``False``: sequentially,
    AAS). See docs/parm.md.
    """

    d_model: int
    d_expert: int
    num_experts: int
    top_k: int = 2
    capacity_factor: float | None | str = "auto"
    router: str = "topk"
    activation: str = "gelu"
    expert_bias: bool = False
    structure: str = "vanilla"
    downscale_factor: float | None = None
    gate_noise: float = 0.0
    renormalize: bool | None = None
    aux_loss_coef: float = 0.01
    balance_loss: str = "all_choices"
    z_loss_coef: float = 0.0
    # SMILE bi-level routing (router="bilevel"): experts in `bilevel_nodes` equal groups, one
    # per node; top `node_top_k` nodes x top `local_top_k` experts of a node per token
    # (top_k must be their product); the intra-node loss coefficient beta defaults to alpha.
    bilevel_nodes: int | None = None
    node_top_k: int = 1
    local_top_k: int = 1
    local_loss_coef: float | None = None
    # settings only one router knows (e.g. router="deepseek_v3": n_group, topk_group, ...),
    # checked by that router class (Router.OPTIONS)
    router_options: dict | None = None
    # Today's architectures (DeepSeek-V3 section 2.1): shared experts (DeepSeek-V3, Qwen2-MoE)
    # computed on every rank beside the routed ones, of hidden width num_shared_experts *
    # shared_expert_hidden (default d_expert), optionally scaled by Qwen2-MoE's gate
    # sigmoid(x W_g); the activation's own settings (e.g. clamped_swiglu's alpha / limit,
    # checked by the Activation class); the expert module by name (the "experts" registry).
    num_shared_experts: int = 0
    shared_expert_hidden: int | None = None
    shared_expert_gate: bool = False
    activation_options: dict | None = None
    expert_module: str = "ffn"
    codec: str = "none"
    codec_backward: bool = False
    a2a: str = "direct"
    schedule: str = "sequential"
    pipeline_degree: int = 1
    seed: int = 0
    layer_id: int = 0
    # Parm (Section III): schedule of MP+EP+ESP, and S2's SAA (True) or AAS (False, III-D)
    parallel_schedule: str = "baseline"
    parm_saa: bool = True
    # S2, and the baseline with the ESP group inside the MP group: compare a digest of the
    # dispatch plan over the MP group each call (a debug check:
    # one host sync and a small all-reduce; moeflow/strategies/parm/plan_agreement.py)
    parm_check_plan: bool = False
    # parallel_schedule="auto": at the layer's first training call (grad enabled, outside an
    # activation checkpoint), time Algorithm 1's candidates on that call's input (1 warm-up + 2
    # forward + backward steps each, best predicted first, within autotune_budget_s) and weigh
    # only those measured, each prediction scaled by its measured / predicted ratio (beyond
    # the paper; moeflow/strategies/parm/measured_choice.py). False: Algorithm 1 alone.
    parm_auto_measure: bool = True
    # Auto-tuning (moeflow/autotune/, docs/autotune.md): codec="auto:lossy" lets the tuner pick
    # a lossy codec whose relative L2 error (layer output and input gradient vs the lossless
    # exchange, tuning batch, worst rank) is <= lossy_error_budget (None: 1e-2); the tuning
    # of any "auto" field stops measuring after autotune_budget_s seconds (None: unbounded)
    lossy_error_budget: float | None = None
    autotune_budget_s: float | None = DEFAULT_AUTOTUNE_BUDGET_S

    # The strategy, by its registry name (moeflow/strategies/, docs/design.md "Strategies"):
    # "ep" = static expert parallelism; "parm" = Parm's MP / ESP layouts and schedules;
    # "fssdp" = HECATE's experts fully sharded (one owner each), materialized per iteration
    # by spAG; "node_dedup" = the node-deduplicated exchange; "auto" = "ep" or "node_dedup",
    # measured by the auto-tuner at the first forward (AUTO_PLACEMENTS, docs/autotune.md).
    # The options of a strategy that takes some (FSSDP's: a dict or its OPTIONS class) are
    # checked by that class.
    placement: str = "ep"
    fssdp: dict | None = None
    # Capacity mode's empty slots (moeflow/dispatch/plan.py): "pad" sends and
    # computes all E*C rows (fixed shapes, no host synchronisation: Tutel's way); "trim" only
    # each expert's kept rows (same function, fewer bytes and FLOPs, one host sync per call);
    # "auto": trim on CPU (where the sync costs nothing), pad on other devices.
    capacity_padding: str = "auto"
    # A promise that every rank calls the layer with the same number of tokens (and the same
    # top_k / capacity_factor overrides) at each call, e.g. fixed (batch, seq) batches. It
    # lets the layer skip two host collectives after their first call per distinct count:
    # capacity mode's gather of every rank's C_p (moeflow/dispatch/plan.py) and Parm auto's
    # all-reduce of Algorithm 1's predictions (moeflow/strategies/parm/algorithm1.py). Each
    # first call checks the promise and raises a ConfigError naming this field if it fails.
    # None: not declared (as False; moeflow train declares it for its fixed-shape batches).
    equal_rank_tokens: bool | None = None
    # Activation memory of the experts (moeflow/schedule/pipeline.py, "Recomputation"):
    # "none" keeps each expert's hidden activations for backward; "moe_act" keeps only the
    # exchanged tokens (the experts' input rows) and recomputes the experts' activations in
    # backward (Megatron-core's moe_act recompute; here the first matmul is recomputed too).
    recompute: str = "none"

    def __post_init__(self) -> None:
        o = "MoEConfig"
        _require(self.equal_rank_tokens is None or isinstance(self.equal_rank_tokens, bool), o,
                 "equal_rank_tokens", self.equal_rank_tokens, "must be True (every rank calls "
                 "the layer with the same token count, e.g. fixed-shape batches), False, or "
                 "None (not declared: as False)")
        # the strategy by registry name; its options class validates MoEConfig.fssdp
        strategies = registry("strategy")
        _require(self.a2a != "node_dedup", o, "a2a", self.a2a,
                 "the node-deduplicated exchange is a strategy: set placement='node_dedup' "
                 "(and a2a to a row exchange, e.g. 'direct')")
        _require(self.placement in strategies or self.placement == AUTO, o, "placement",
                 self.placement,
                 f"choose one of {', '.join(sorted(strategies))} (docs/design.md, "
                 f"\"Strategies\"), or 'auto' (the tuner measures "
                 f"{' and '.join(AUTO_PLACEMENTS)})"
                 f"{did_you_mean(self.placement, [*strategies, AUTO])}")
        if self.placement == AUTO:
            _require(self.fssdp is None, o, "fssdp", self.fssdp,
                     "FSSDP options need placement='fssdp'; placement='auto' chooses between "
                     f"{' and '.join(AUTO_PLACEMENTS)}, which take none: drop the options")
        else:
            self.fssdp = strategies[self.placement].check_options(self)
        # auto-tuning: a2a / schedule / pipeline_degree may be "auto", resolved
        # collectively by the layer's first forward (moeflow/autotune/tuner.py)
        if self.pipeline_degree != AUTO:
            _require(isinstance(self.pipeline_degree, int)
                     and not isinstance(self.pipeline_degree, bool) and self.pipeline_degree > 0,
                     o, "pipeline_degree", self.pipeline_degree,
                     "must be a positive integer, or 'auto' (measured at the first forward)")
        _require(self.recompute in MOE_RECOMPUTES, o, "recompute", self.recompute,
                 "choose 'none' (keep the experts' activations) or 'moe_act' (keep the "
                 "exchanged tokens, recompute the experts' activations in backward)")
        _require(self.capacity_padding in CAPACITY_PADDINGS, o, "capacity_padding",
                 self.capacity_padding, "choose 'auto' (trim on CPU, pad elsewhere), 'pad' "
                 "(send all E*C capacity rows) or 'trim' (send only the kept rows)")
        _require(self.capacity_padding != "trim" or all(
                     strategies[p].supports_trim for p in
                     (AUTO_PLACEMENTS if self.placement == AUTO else (self.placement,))),
                 o, "capacity_padding", self.capacity_padding,
                 "'trim' works with a placement that sends only kept rows ('ep', "
                 "'node_dedup', 'parm': its ted, pipelined ted, S1 and whole-expert baseline; "
                 "S2 and the baseline with ESP shards pad, docs/parm.md); FSSDP builds its own "
                 "capacity layout: use 'auto' or 'pad'")
        _require(self.parallel_schedule in PARM_SCHEDULES, o, "parallel_schedule",
                 self.parallel_schedule, "unknown schedule; use one of "
                 f"{', '.join(PARM_SCHEDULES)} (Parm Fig. 3a, 3b, 3c, Algorithm 1; ted: "
                 "DeepSpeed-TED's order, docs/parm.md)")
        _require(isinstance(self.parm_check_plan, bool), o, "parm_check_plan",
                 self.parm_check_plan, "must be True (compare the MP ranks' plans in S2) or "
                 "False")
        _require(isinstance(self.parm_saa, bool), o, "parm_saa", self.parm_saa,
                 "must be True (SAA) or False (AAS)")
        _require(isinstance(self.parm_auto_measure, bool), o, "parm_auto_measure",
                 self.parm_auto_measure, "must be True (parallel_schedule='auto' times "
                 "Algorithm 1's candidates at the first training call and weighs the measured "
                 "ones) or False (Algorithm 1's prediction alone)")
        if self.router == "bilevel":
            self._bilevel_options_to_fields(o)
            self._check_bilevel(o)
        for name in ("d_model", "d_expert", "num_experts", "top_k"):
            _positive_int(o, name, getattr(self, name))
        _require(self.top_k <= self.num_experts, o, "top_k", self.top_k,
                 f"must be <= num_experts ({self.num_experts}); lower top_k or add experts")
        self.capacity_factor = _check_structure(o, self.structure, self.capacity_factor,
                                                self.downscale_factor, self.d_model,
                                                self.d_expert)
        if self.capacity_factor is not None:
            _require(isinstance(self.capacity_factor, (int, float))
                     and not isinstance(self.capacity_factor, bool)
                     and self.capacity_factor > 0,
                     o, "capacity_factor", self.capacity_factor,
                     "must be > 0 (e.g. 1.25), None for dropless routing, or 'auto'")
        _check_activation(o, self.activation)
        _require(isinstance(self.expert_bias, bool), o, "expert_bias", self.expert_bias,
                 "must be True (experts W2 act(W1 x + b1) + b2, Tutel's has_fc1_bias / "
                 "has_fc2_bias) or False")
        _require(isinstance(self.gate_noise, (int, float)) and self.gate_noise >= 0, o,
                 "gate_noise", self.gate_noise, "must be >= 0 (0 disables router noise)")
        for name in ("aux_loss_coef", "z_loss_coef"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and v >= 0, o, name, v, "must be >= 0")
        _require(self.balance_loss in BALANCE_LOSSES, o, "balance_loss", self.balance_loss,
                 "choose 'all_choices' (f_e counts all top-k choices, Megatron-core) or "
                 "'first_choice' (f_e counts each token's first choice, GShard / DeepSpeed-MoE "
                 "/ Tutel)")
        _require(isinstance(self.seed, int) and self.seed >= 0, o, "seed", self.seed,
                 "must be a non-negative integer")
        _require(isinstance(self.layer_id, int) and self.layer_id >= 0, o, "layer_id",
                 self.layer_id, "must be a non-negative integer")
        for name, kind in (("router", "router"), ("codec", "codec"), ("a2a", "alltoall"),
                           ("schedule", "scheduler")):
            v = getattr(self, name)
            if v == AUTO and name in ("a2a", "schedule"):      # tuned at run time
                continue
            if name == "codec" and v == AUTO_LOSSY:              # tuned, lossy codecs too
                continue
            _require(not (name == "codec" and v == AUTO), o, "codec", v,
                     "the only lossless codec is 'none' (the default), so there is nothing "
                     "lossless to choose; use codec='none', or codec='auto:lossy' (with "
                     "lossy_error_budget) to let the tuner pick a lossy codec within an error "
                     "budget")
            reg = registry(kind)
            _require(v in reg, o, name, v,
                     f"unknown name; registered: {', '.join(sorted(reg))} "
                     f"(register your own with moeflow.register_{kind})"
                     f"{did_you_mean(v, reg)}")
        _require(self.router_options is None or isinstance(self.router_options, dict), o,
                 "router_options", self.router_options,
                 "must be a dict of the router's settings (or None)")
        self.router_options = registry("router")[self.router].check_options(self)
        self._check_architecture_pieces(o)
        self._check_tuning_budgets(o)

    def _check_tuning_budgets(self, o: str) -> None:
        """lossy_error_budget and autotune_budget_s (the auto-tuner's, moeflow/autotune/)."""
        b = self.lossy_error_budget
        if b is not None:
            _require(self.codec == AUTO_LOSSY, o, "lossy_error_budget", b,
                     f"it only applies to codec='{AUTO_LOSSY}' (codec is {self.codec!r}); set "
                     f"codec='{AUTO_LOSSY}' or drop lossy_error_budget")
            _require(isinstance(b, (int, float)) and not isinstance(b, bool) and b >= 0, o,
                     "lossy_error_budget", b,
                     "must be a number >= 0: the largest relative L2 error of the layer's "
                     "output and input gradient allowed (e.g. 1e-2; 0 keeps codec 'none')")
        t = self.autotune_budget_s
        if t is not None:
            _require(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0, o,
                     "autotune_budget_s", t,
                     "must be a number of seconds > 0 (e.g. 30), or None for no time limit")

    @property
    def effective_lossy_error_budget(self) -> float | None:
        """The error budget codec='auto:lossy' tunes with (None for other codecs)."""
        if self.codec != AUTO_LOSSY:
            return None
        b = self.lossy_error_budget
        return DEFAULT_LOSSY_ERROR_BUDGET if b is None else float(b)

    def _check_architecture_pieces(self, o: str) -> None:
        """Shared experts (DeepSeek-V3, Qwen2-MoE), activation options, expert module."""
        n = self.num_shared_experts
        _require(isinstance(n, int) and not isinstance(n, bool) and n >= 0, o,
                 "num_shared_experts", n, "must be an integer >= 0 (0: no shared experts)")
        if self.shared_expert_hidden is not None:
            _positive_int(o, "shared_expert_hidden", self.shared_expert_hidden)
        _require(isinstance(self.shared_expert_gate, bool), o, "shared_expert_gate",
                 self.shared_expert_gate, "must be True (Qwen2-MoE's sigmoid(x W_g) gate on "
                 "the shared experts' output) or False")
        _require(n > 0 or (self.shared_expert_hidden is None and not self.shared_expert_gate),
                 o, "num_shared_experts", n, "shared_expert_hidden / shared_expert_gate are "
                 "set but there are no shared experts; set num_shared_experts >= 1")
        _require(self.activation_options is None or isinstance(self.activation_options, dict),
                 o, "activation_options", self.activation_options,
                 "must be a dict of the activation's settings (or None)")
        acts = registry("activation")
        if self.activation in acts:
            self.activation_options = acts[self.activation].check_options(
                self.activation, self.activation_options)
        else:
            _require(not self.activation_options, o, "activation_options",
                     self.activation_options, f"activation {self.activation!r} (a "
                     "torch.nn.functional function) takes no options; leave it unset")
        reg = registry("experts")
        _require(self.expert_module in reg, o, "expert_module", self.expert_module,
                 f"unknown name; registered: {', '.join(sorted(reg))} (register your own "
                 f"with moeflow.register_experts){did_you_mean(self.expert_module, reg)}")

    @property
    def shared_hidden(self) -> int:
        """The shared experts' total hidden width (0 without shared experts)."""
        return self.num_shared_experts * (self.shared_expert_hidden or self.d_expert)

    def _bilevel_options_to_fields(self, o: str) -> None:
        """SMILE's settings in the one form every router takes, ``router_options={"nodes": 2,
        "node_top_k": 1, "local_top_k": 1, "local_loss_coef": None}``: moved into the fields
        ``bilevel_nodes``, ``node_top_k``, ``local_top_k``, ``local_loss_coef`` (the older
        spelling, still accepted), so that ``replace`` of either keeps one source of truth."""
        if not isinstance(self.router_options, dict):
            return
        fields = {"nodes": "bilevel_nodes", "node_top_k": "node_top_k",
                  "local_top_k": "local_top_k", "local_loss_coef": "local_loss_coef"}
        defaults = {"bilevel_nodes": None, "node_top_k": 1, "local_top_k": 1,
                    "local_loss_coef": None}
        opts = dict(self.router_options)
        for key in opts:
            _require(key in fields, o, "router_options", self.router_options,
                     f"router 'bilevel' does not take {key!r} (its options: "
                     f"{', '.join(fields)}){did_you_mean(key, fields)}")
        for key, name in fields.items():
            if key not in opts:
                continue
            value = opts.pop(key)
            current = getattr(self, name)
            _require(current == defaults[name] or current == value, o,
                     f"router_options['{key}']", value,
                     f"it contradicts {name}={current!r}; give SMILE's setting once, as "
                     f"router_options['{key}']")
            setattr(self, name, value)
        self.router_options = opts or None

    def _check_bilevel(self, o: str) -> None:
        n = self.bilevel_nodes
        _require(isinstance(n, int) and n > 0, o, "bilevel_nodes", n,
                 "router='bilevel' needs the number of nodes the experts are grouped into "
                 "(e.g. bilevel_nodes=2 for 2 nodes)")
        _require(self.num_experts % n == 0, o, "num_experts", self.num_experts,
                 f"must be a multiple of bilevel_nodes={n} (the same experts on every node)")
        m = self.num_experts // n
        _positive_int(o, "node_top_k", self.node_top_k)
        _positive_int(o, "local_top_k", self.local_top_k)
        _require(self.node_top_k <= n, o, "node_top_k", self.node_top_k,
                 f"must be <= bilevel_nodes={n}")
        _require(self.local_top_k <= m, o, "local_top_k", self.local_top_k,
                 f"must be <= the {m} experts of a node")
        _require(self.top_k == self.node_top_k * self.local_top_k, o, "top_k", self.top_k,
                 f"with router='bilevel' it must equal node_top_k x local_top_k = "
                 f"{self.node_top_k * self.local_top_k}; set top_k="
                 f"{self.node_top_k * self.local_top_k}")
        if self.local_loss_coef is not None:
            _require(self.local_loss_coef >= 0, o, "local_loss_coef", self.local_loss_coef,
                     "must be >= 0, or None for the same value as aux_loss_coef")

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    @property
    def downscale(self) -> float:
        """BigMac's r (1.0 for the structures that communicate at d_model)."""
        if self.structure != "bigmac":
            return 1.0
        return DEFAULT_DOWNSCALE_FACTOR if self.downscale_factor is None else \
            float(self.downscale_factor)

    @property
    def renormalize_topk(self) -> bool:
        """Whether the k selected gate weights are rescaled to sum to one.

        Default: yes for k >= 2 (GShard), no for k = 1 (Switch: the raw probability scales the
        output, which is what trains the router).
        """
        return self.renormalizes(self.top_k)

    def renormalizes(self, k: int) -> bool:
        """:attr:`renormalize_topk` for a call routed with top-``k`` (a per-call override)."""
        return k > 1 if self.renormalize is None else self.renormalize

    def per_call(self, top_k=None, capacity_factor=FROM_CONFIG) -> tuple[int, float | None]:
        """``(top_k, capacity_factor)`` for one call of the layer: the config's values, or the
        per-call overrides of ``MoELayer.forward`` (Tutel's ``moe(x, top_k=...,
        capacity_factor=...)``), validated like the fields. ``capacity_factor`` may be a
        factor > 0, None (dropless) or "auto" (the structure's default)."""
        if top_k is None and capacity_factor is FROM_CONFIG:
            return self.top_k, self.capacity_factor
        o = "MoELayer(x, ...)"
        k = self.top_k if top_k is None else top_k
        if top_k is not None:
            _require(isinstance(k, int) and not isinstance(k, bool) and 0 < k <= self.num_experts,
                     o, "top_k", k, f"must be an integer in [1, num_experts={self.num_experts}], "
                     "or None for MoEConfig.top_k")
        if capacity_factor is FROM_CONFIG:
            return k, self.capacity_factor
        f = _resolve_capacity_factor(self.structure, capacity_factor)
        _require(f is None or (isinstance(f, (int, float)) and not isinstance(f, bool)
                               and f > 0), o, "capacity_factor", capacity_factor,
                 "must be > 0 (e.g. 1.25), None for dropless routing, 'auto' for the "
                 "structure's default, or left out for MoEConfig.capacity_factor")
        return k, f

    @classmethod
    def from_hf(cls, *args, **kwargs) -> "MoEConfig":
        """Moved: the configuration does not import the integrations above it."""
        raise ConfigError("MoEConfig.from_hf(config, ...) moved to "
                          "moeflow.integrations.hf.moe_config_from_hf(config, layer_id=0, "
                          "**overrides); call that instead (same arguments, same result)")

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)
