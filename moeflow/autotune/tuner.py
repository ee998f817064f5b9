"""Auto-tuning of a layer's all-to-all algorithm, schedule and pipelining degree (ScheMoE
sections 3.2 and 4), and of its strategy between expert parallelism and the node-deduplicated
exchange (``placement="auto"``; DeepEP's inter-node dispatch).

``MoEConfig(a2a="auto", schedule="auto", pipeline_degree="auto")`` (any subset) leaves the
choice to the running cluster, as ScheMoE's profiler + scheduler do (ScheMoE section 3.2 and
section 4: the task profiler fits per-task models, the two-lane model of section 4.1 predicts
each (r, schedule), Theorem 1's OptSche is among the candidates). At the layer's first forward
(or :meth:`moeflow.layer.MoELayer.tune`), collectively on every rank of the layer:

1. Screen at r = 1, sequential (1 warm-up + ``reps`` steps, each the slowest rank's time;
   1 rep when the time budget cannot hold them all): the placeholder's algorithm (direct)
   lossless first; with ``codec="auto:lossy"`` then every registered lossy codec that takes
   the payload's dtype, most wire bytes (the gentlest) first, whose warm-up step measures
   its error against the lossless exchange (:mod:`moeflow.autotune.lossy`: relative L2 of
   the output and of the input gradient, worst rank) and which is not timed when over
   ``lossy_error_budget``; with ``placement="auto"``, then the node-deduplicated exchange
   (DeepEP's inter-node dispatch, :mod:`moeflow.strategies.node_dedup.strategy`), lossless,
   under the label ``DEDUP_ROUTE`` in the place of an algorithm, where it can run
   (:func:`placement_candidates`: several nodes, its ``check_config``; otherwise
   ``TunedChoice.placements`` says why not); with a time budget, then the overlap trials on
   the best pair so far (OptSche at each r > 1, :func:`screen_order`); then every other
   usable all-to-all algorithm (``check_topology`` passes), lossless. With ``node_dedup``
   screened, the paired placement screen (:mod:`moeflow.autotune.paired`) re-times it and
   expert parallelism on the first algorithm in interleaved pairs and decides by the median
   of the pairs' ratios whether ``node_dedup`` stays a candidate (:func:`pick`'s
   ``dedup_ok``). The best two (codec, algorithm or ``DEDUP_ROUTE``) pairs are kept.
2. Profile + predict: :func:`moeflow.schedule.chooser.choose` profiles those at r in
   ``DEGREES`` and predicts every (codec, algorithm, schedule, r) candidate.
3. Measure: the ``MEASURE_TOP`` best predictions are run (1 warm-up + ``reps`` steps), but
   for those the screen measured already; the fastest *measured* median of all stages wins,
   unless a simpler candidate (expert parallelism rather than ``node_dedup``, then fewer
   chunks, then sequential) is within ``SIMPLER_MARGIN`` of it (:func:`pick`): ``node_dedup``
   is kept only where it beats every measured expert-parallel candidate by more than that.
   Every timing is the maximum over ranks (a host all-reduce), so every rank computes the
   same numbers and fixes the same choice.

The codec stays the config's (lossless ``none`` by default) unless the config opts in with
``codec="auto:lossy"``: lossy codecs change the function, so they are never picked otherwise
(plain ``codec="auto"`` is refused by MoEConfig: ``none`` is the only lossless codec). Tuning
changes speed only: the layer's parameters, gradients and random state are as before it, and
the real forward that follows runs with the chosen settings (float64 parity in
tests/multirank/test_autotune.py and tests/multirank/test_autotune_lossy.py).

Time budget (``MoEConfig.autotune_budget_s``, default 30 s; None: unbounded): before each
measured candidate, each further repetition and the profile stage, the ranks ask
:class:`moeflow.autotune.clock.TuneClock` whether the estimated work (steps x the last step
time, both the slowest rank's) still ends within the budget; the answer is the same on every
rank. When not, the rest of that stage is cut: fewer repetitions, fewer screened candidates,
the profile on one pair or skipped (then the overlapping schedules of the best screened pair
at the smallest r > 1 are measured without prediction), fewer measured candidates; the best
measured so far wins and ``TunedChoice.budget_cut`` / the log line say what was cut. Always
made: the first measurement (1 warm-up + 1 step) and, where an overlapping schedule is a
candidate, the first overlap trial (OptSche at the largest r, 1 warm-up + 1 step;
:func:`always_measured`), so that a budget that holds one step still weighs ScheMoE's schedule
against the sequential one.

Re-tuning: the layer records the rows its EP group sends per forward (the count matrix, known
to every rank of the group); every ``layer.retune_check_every`` (default
``RETUNE_CHECK_EVERY``) training forwards, all ranks agree in one host all-reduce whether any
group's rows differ by more than ``RETUNE_RATIO`` from the rows at tuning time, and if so
they re-tune together (EP groups may see different rows: deciding alone could leave a rank
waiting in the tuner's collectives).

Without a time budget the cost is bounded by construction: ``(algorithms + lossy codecs) x
(1 + reps) + 2 x choose's profile steps + MEASURE_TOP x (1 + reps)`` forward + backward steps,
plus ``2 x (1 + PAIRED_REPS)`` for the paired placement screen with ``placement="auto"``.

Output (logger ``moeflow.autotune``, rank 0): each stage logs a detail line with its elapsed
time at DEBUG, and each tuning one INFO line (layer, token count, the choice, the tuning's
time) carrying the choice for the run folder's record (:mod:`moeflow.autotune.runlog`).
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from moeflow.autotune.clock import TuneClock
from moeflow.autotune.lossy import ErrorProbe, gentlest_first, lossy_candidates
from moeflow.autotune.paired import PAIRED_REPS, dedup_wins
from moeflow.measure.timing import paired_times
from moeflow.autotune.settings import _Preserved, apply
from moeflow.config import AUTO, AUTO_LOSSY, AUTO_PLACEMENTS, MoEConfig

log = logging.getLogger("moeflow.autotune")

AUTO_FIELDS = ("a2a", "schedule", "pipeline_degree", "codec", "placement")
SCHEDULES = ("sequential", "pipelined", "optsche")
DEGREES = (1, 2, 4)
KEEP_ALGOS = 2          # algorithms kept after the screen
MEASURE_TOP = 3         # predicted candidates measured before the final choice
SIMPLER_MARGIN = 0.05   # a simpler candidate within this fraction of the fastest wins (pick)
RETUNE_RATIO = 2.0      # re-tune when the rows per forward change by more than this factor
RETUNE_CHECK_EVERY = 50  # training forwards between the collective re-tune checks
# placement="auto": the screen / profile label of the node-deduplicated exchange, in the place
# of an all-to-all algorithm's name (no algorithm is called so: MoEConfig refuses
# a2a="node_dedup"); its candidates run with placement="node_dedup" (:func:`concrete`)
DEDUP_ROUTE = "node_dedup"


@dataclass
class TunedChoice:
    """What the tuner fixed, with its prediction and measurement (milliseconds, forward +
    backward of the layer, slowest rank), and the topology it was measured on."""

    a2a: str
    schedule: str
    pipeline_degree: int
    predicted_ms: float | None        # None where nothing was predicted (one rank, screen)
    measured_ms: float | None
    topology: str                     # layout(topo): a resume on another layout re-tunes
    rows: int | None = None           # rows sent per forward over the EP group when tuned
    tune_s: float = 0.0               # wall time the tuning took
    candidates: list[dict] = field(default_factory=list)   # every measured candidate
    codec: str = "none"               # the codec (tuned with codec="auto:lossy")
    codec_error: float | None = None  # its relative L2 error (worst rank; 0.0 for "none")
    codec_errors: dict = field(default_factory=dict)       # every lossy codec's error
    lossy_error_budget: float | None = None   # the budget it was chosen under
    budget_s: float | None = None     # autotune_budget_s it was tuned with
    budget_cut: list[str] = field(default_factory=list)    # what the time budget cut short
    max_step_ms: float | None = None  # the longest timed step (slowest rank's) while tuning
    placement: str = "ep"             # the strategy (tuned with placement="auto")
    # placement="auto": each of AUTO_PLACEMENTS -> "candidate", or why it was not one
    placements: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TunedChoice":
        # "node_dedup_rule": written before node_dedup became a strategy (placement), when
        # the tuner screened it; informational only, so a resume does not need it
        return cls(**{k: v for k, v in d.items() if k != "node_dedup_rule"})

    def settings(self) -> dict:
        return {"a2a": self.a2a, "schedule": self.schedule,
                "pipeline_degree": self.pipeline_degree}


def layout(topo) -> str:
    """The topology without this rank's position: equal on every rank of a job."""
    return re.sub(r"\brank=\d+, ", "", repr(topo))


def auto_fields(cfg: MoEConfig) -> tuple[str, ...]:
    """The fields of ``cfg`` left to the tuner (codec: with ``"auto:lossy"``)."""
    return tuple(f for f in AUTO_FIELDS
                 if getattr(cfg, f) == (AUTO_LOSSY if f == "codec" else AUTO))


def placeholder(cfg: MoEConfig) -> MoEConfig:
    """``cfg`` with its auto fields set to the untuned defaults (direct, sequential, r = 1,
    codec none), used until the first forward tunes them."""
    defaults = {"a2a": "direct", "schedule": "sequential", "pipeline_degree": 1,
                "codec": "none", "placement": AUTO_PLACEMENTS[0]}
    fields = auto_fields(cfg)
    extra = {"lossy_error_budget": None} if "codec" in fields else {}
    return cfg.replace(**{f: defaults[f] for f in fields}, **extra)


def retune_agreed(layer) -> bool:
    """Whether to re-tune now, decided by every rank together: each
    ``layer.retune_check_every``-th training forward (None: never), one host all-reduce (max)
    of each rank's :func:`needs_retune` flag over the world. The rows are those of the rank's
    own EP group, so two EP groups can see different rows; agreeing first means no rank enters
    the (collective) tuning alone, and between checks there is no extra message."""
    from moeflow.measure.timing import slowest

    if layer.retune_check_every is None:     # never (moeflow train --deterministic)
        return False
    layer._forwards += 1
    if layer._forwards % max(1, layer.retune_check_every):
        return False
    flag = float(needs_retune(layer.tuned.rows, layer._rows))
    return slowest(flag, layer.topo) > 0


def needs_retune(tuned_rows: int | None, rows: int | None) -> bool:
    """Whether the rows per forward moved by more than ``RETUNE_RATIO`` since tuning."""
    if not tuned_rows or rows is None:
        return False
    return rows > RETUNE_RATIO * tuned_rows or rows * RETUNE_RATIO < tuned_rows


def candidate_algorithms(requested: MoEConfig, topo) -> list[str]:
    """Algorithms that can run on ``topo`` (and with Parm's ESP shards, those it supports)."""
    from moeflow.comm.alltoall import ALLTOALLS
    from moeflow.errors import ConfigError

    if requested.a2a != AUTO:
        return [requested.a2a]
    ok = []
    for name, cls in sorted(ALLTOALLS.items()):
        if not getattr(cls, "auto_candidate", True):
            continue
        try:
            cls.check_topology(topo)
        except ConfigError:
            continue
        ok.append(name)
    if topo.esp_size > 1:
        from moeflow.strategies.parm.checks import ESP_ALLTOALLS
        ok = [a for a in ok if a in ESP_ALLTOALLS]
    return ok


def placement_candidates(requested: MoEConfig, topo) -> dict[str, str]:
    """With ``placement="auto"``: each of ``AUTO_PLACEMENTS`` -> ``"candidate"``, or why the
    tuner does not measure it (top-1 routing, which leaves nothing to deduplicate, or
    ``node_dedup``'s own ConfigError: one node, an EP group smaller than the world, Parm's
    MP / ESP, ``recompute="moe_act"``, ...). ``"ep"`` is
    always a candidate (on Parm's layouts it is Parm's baseline schedule, expert
    parallelism there). Empty for any other placement."""
    from moeflow.errors import ConfigError
    from moeflow.strategies import STRATEGIES

    if requested.placement != AUTO:
        return {}
    out = {}
    for name in AUTO_PLACEMENTS:
        if name == "node_dedup" and requested.top_k == 1:
            # one expert per token puts it on one node: the deduplicated exchange sends the
            # same inter-node rows as the direct one and only adds the relay hop (measured
            # 1.21x slower at top-1, docs/benchmarks/layer.md), so it is never worth a screen
            out[name] = ("not a candidate: top_k=1 sends each token to one node, so there "
                         "is nothing to deduplicate")
            continue
        try:
            STRATEGIES[name].check_config(placeholder(requested).replace(placement=name), topo)
            out[name] = "candidate"
        except ConfigError as err:
            out[name] = f"not a candidate: {err}"
    return out


def concrete(cfg: MoEConfig, codec: str, route: str, schedule: str | None = None,
             r: int | None = None) -> MoEConfig:
    """``cfg`` (concrete) with the candidate's codec, route (an all-to-all algorithm, or
    ``DEDUP_ROUTE``: ``placement="node_dedup"``, whose own hops replace the algorithm, which
    stays ``cfg``'s) and, when given, schedule and pipelining degree."""
    more = {} if schedule is None else {"schedule": schedule, "pipeline_degree": r}
    if route == DEDUP_ROUTE:
        return cfg.replace(codec=codec, placement="node_dedup", **more)
    return cfg.replace(codec=codec, a2a=route, **more)


def _step_of(layer, x: torch.Tensor):
    """The forward + backward step every timing of the tuner runs (:func:`_measure`,
    :func:`_time_step`)."""
    from moeflow.measure.timing import layer_step

    return lambda: layer_step(layer, x)


def _measure(layer, cfg: MoEConfig, x: torch.Tensor, reps: int, clock: TuneClock,
             warmup=None) -> float | None:
    """Median seconds of up to ``reps`` forward + backward steps (after one warm-up), each step
    the slowest rank's: the same number on every rank. After the first timed step, a further
    one runs only while ``clock`` says it fits the time budget (the same answer on every
    rank), so the repetitions adapt to the step time. ``warmup`` (collective, returns whether
    to go on: the same answer on every rank) replaces the warm-up step, e.g. an error probe
    of ``codec="auto:lossy"``; None is returned when it says no."""
    from moeflow.measure.timing import time_aligned

    step = _step_of(layer, x)
    apply(layer, cfg)
    times, go = [], [True]
    for i in range(1 + reps):
        if i >= 2 and not clock.fits(1):
            clock.note_cut(f"{cfg.codec}/{cfg.a2a}/{cfg.schedule}/r={cfg.pipeline_degree}: "
                           f"{i - 1} of {reps} reps")
            break
        if i == 0 and warmup is not None:
            times.append(time_aligned(lambda: go.__setitem__(0, warmup()), layer.topo,
                                      x.device))
        else:
            times.append(time_aligned(step, layer.topo, x.device))
        clock.note_step(times[-1], estimate=i > 0)     # warm-ups / probes: not estimates
        layer.zero_grad(set_to_none=True)
        if not go[0]:
            return None
    return statistics.median(times[1:])


def _say(topo, msg: str) -> None:
    """A screening detail line (DEBUG: the run folder's ``autotune.log`` under ``moeflow
    train``, :mod:`moeflow.autotune.runlog`), rank 0 only."""
    if topo.rank == 0:
        log.debug(msg)


def _announce(topo, choice: TunedChoice, layer_id: int | None, tokens: int, msg: str) -> None:
    """The one line per tuning (INFO, rank 0): what was chosen and how long it took. The log
    record carries the choice, the layer id and the batch's token count, for the run folder's
    ``autotune.jsonl`` (:mod:`moeflow.autotune.runlog`)."""
    if topo.rank == 0:
        log.info(msg, extra={"tuned": {"layer_id": layer_id, "tokens": tokens,
                                       "source": "measured", "choice": choice.as_dict()}})


def _entry(e: tuple) -> str:
    """A screen entry as the cut note names it: ``codec/algorithm`` or ``schedule/r=R``."""
    kind, a, b = e
    return f"{a}/{b}" if kind == "screen" else f"{a}/r={b}"


def _route(m: dict) -> str:
    """A measured candidate's route: its algorithm, or ``DEDUP_ROUTE`` for ``node_dedup``."""
    return DEDUP_ROUTE if m.get("placement") == "node_dedup" else m["a2a"]


def _key(c) -> tuple:
    """(codec, route, schedule, r) of a measured candidate (dict) or a predicted one (the
    chooser's Candidate, whose ``a2a`` is the route it was profiled under)."""
    if isinstance(c, dict):
        return (c["codec"], _route(c), c["schedule"], c["pipeline_degree"])
    return (c.codec, c.a2a, c.schedule, c.pipeline_degree)


def overlap_trials(schedules: list[str], degrees: list[int]) -> list[tuple[str, int]]:
    """(schedule, r) of the early overlap trials of a budgeted tuning: ScheMoE's OptSche
    (Theorem 1: never slower than the pipelined order in the two-lane model) at every allowed
    pipelining degree above 1, largest first; the pipelined order where OptSche is not
    allowed; none where neither is. Largest first because the budget often holds only one
    trial, and six of the seven unbounded tunings on record that chose an overlapped schedule
    chose the largest degree (docs/autotune.md, "Time budget")."""
    s = next((s for s in ("optsche", "pipelined") if s in schedules), None)
    return [(s, r) for r in sorted(degrees, reverse=True) if r > 1] if s is not None else []


def screen_order(lossless: str, first: str, lossy: list[str], others: list[str],
                 schedules: list[str], degrees: list[int], budgeted: bool,
                 placements: list[str] = ()) -> list[tuple]:
    """The screen's entries, in order: ``("screen", codec, algorithm)`` at r = 1 sequential,
    or ``("overlap", schedule, r)`` on the best pair screened so far. The first algorithm
    lossless, then the lossy codecs on it (gentlest first), then the other algorithms,
    lossless. With a time budget the overlap trials come before the other algorithms: the
    budget often ends the screen there, and overlapping the exchange with the experts
    (ScheMoE's r and OptSche) is the larger lever where the exchange is a large share of the
    step (measured: docs/benchmarks/layer.md, the auto-tuning table at the final code).
    Unbounded, every pair is screened and the profile predicts the overlapping candidates,
    so the order is the plain one. ``placements`` (``placement="auto"``: ``DEDUP_ROUTE``
    where it can run) come right after the first algorithm's codecs, lossless: the other
    strategy changes what crosses the nodes (one row per token and node instead of per
    choice), the largest lever where the link binds, and a time budget that ends the screen
    early would otherwise never measure it; ``direct`` (the untuned setting) is always
    measured before it, so it can only win by beating that measurement."""
    order = [("screen", lossless, first)] + [("screen", c, first) for c in lossy]
    order += [("screen", lossless, p) for p in placements]
    if budgeted:
        order += [("overlap", s, r) for s, r in overlap_trials(schedules, degrees)]
    return order + [("screen", lossless, a) for a in others]


def always_measured(order: list[tuple]) -> int | None:
    """The index in the screen ``order`` of the trial measured whatever the budget, beside the
    first measurement: the first overlap trial (OptSche at the largest r, :func:`overlap_trials`;
    only a budgeted screen has overlap trials). Without it, a budget that holds one measurement
    (steps of 5 s or more against the 30 s default) would always keep the untuned sequential
    setting, and ScheMoE's schedule (sections 3.2, 4) would never be weighed against it."""
    return next((i for i, e in enumerate(order) if e[0] == "overlap"), None)


def _fallback_trials(pair: tuple[str, str], schedules: list[str], degrees: list[int]) -> list:
    """Candidates measured without predictions when the budget leaves no time to profile:
    the best screened (codec, algorithm) with the overlapping schedules at the largest
    pipelining degree (ScheMoE's OptSche first, Theorem 1; the degree as
    :func:`overlap_trials` orders it)."""
    r = max((d for d in degrees if d > 1), default=None)
    order = [s for s in ("optsche", "pipelined") if s in schedules]
    return [((pair[0], pair[1], s, r), None) for s in order] if r is not None else []


def _time_step(layer, cfg: MoEConfig, x: torch.Tensor, clock: TuneClock) -> float:
    """One forward + backward step of ``layer`` with the settings of ``cfg``, in seconds,
    the slowest rank's (the same on every rank); it becomes the clock's step estimate."""
    from moeflow.measure.timing import time_aligned

    apply(layer, cfg)
    t = time_aligned(_step_of(layer, x), layer.topo, x.device)
    layer.zero_grad(set_to_none=True)
    clock.note_step(t)
    return t


def _paired_placement(layer, x: torch.Tensor, clock: TuneClock, measured: list[dict],
                      screen: dict, ep_cfg: MoEConfig, dedup_cfg: MoEConfig) -> bool:
    """The placement screen (:mod:`moeflow.autotune.paired`): ``ep_cfg`` and ``dedup_cfg``
    (both screened already) timed in interleaved pairs; their screen entries in ``measured``
    and ``screen`` become the medians of the paired steps, and the result says whether
    ``node_dedup`` beats expert parallelism by more than ``SIMPLER_MARGIN`` (the same on
    every rank: every time is the slowest rank's)."""
    def timed(cfg):
        return lambda: _time_step(layer, cfg, x, clock)

    ep, dedup = paired_times(timed(ep_cfg), timed(dedup_cfg), PAIRED_REPS, clock.fits)
    if len(ep) < PAIRED_REPS:
        clock.note_cut(f"paired placement screen: {len(ep)} of {PAIRED_REPS} pairs")
    for cfg, times in ((ep_cfg, ep), (dedup_cfg, dedup)):
        key = (cfg.codec, DEDUP_ROUTE if cfg.placement == "node_dedup" else cfg.a2a,
               cfg.schedule, cfg.pipeline_degree)
        m = next(m for m in measured if m["stage"] == "screen" and _key(m) == key)
        m["measured_ms"] = 1e3 * statistics.median(times)
        m["paired_ms"] = [1e3 * t for t in times]
        screen[(cfg.codec, _route(m))] = m["measured_ms"]
    return dedup_wins(ep, dedup, SIMPLER_MARGIN)


def pick(measured: list[dict], margin: float = SIMPLER_MARGIN, dedup_ok: bool = True) -> dict:
    """The winner among the measured candidates: the simplest of those within ``margin`` of
    the fastest median (expert parallelism before ``node_dedup``, then fewest chunks, then
    the sequential schedule, then the fastest): ``node_dedup`` (``placement="auto"``) wins
    only where its median beats every measured expert-parallel candidate by more than
    ``margin``, as an overlapping schedule must beat the sequential one. The
    candidates are timed with 1-2 steps each, and a pipelined one (r > 1, or an overlapping
    schedule) that is faster by less than the step-to-step noise is as likely slower: on the
    emulated 2x2 cluster at 100 Mbit/s OptSche at r = 4 was once measured 0.7 % faster than
    r = 1 in one step (1778 vs 1791 ms) and then ran at a median of 1935 ms over 25 steps
    (r = 1: 1692 and 1722 ms in two other runs), while where overlap pays it beat r = 1 by
    12-18 % (docs/benchmarks/layer.md, the auto-tuning table at the final code)."""
    if not dedup_ok:      # the paired placement screen kept expert parallelism
        measured = [m for m in measured if m.get("placement", "ep") != "node_dedup"] or measured
    fastest = min(m["measured_ms"] for m in measured)
    near = [m for m in measured if m["measured_ms"] <= fastest * (1.0 + margin)]
    return min(near, key=lambda m: (m.get("placement", "ep") == "node_dedup",
                                    m["pipeline_degree"], m["schedule"] != "sequential",
                                    m["measured_ms"]))


def tune(layer, x: torch.Tensor, requested: MoEConfig, reps: int = 2,
         name: str = "") -> TunedChoice:
    """Choose the auto fields of ``requested`` for ``layer`` on input ``x`` (collective over
    every rank of the layer's topology; all ranks must call it together)."""
    from moeflow.schedule.chooser import choose

    topo = layer.topo
    clock = TuneClock(requested.autotune_budget_s, topo)
    t0 = clock.t0
    label = f"autotune {name or 'layer'} (layer_id {requested.layer_id})"
    fixed = placeholder(requested)
    budget = requested.effective_lossy_error_budget      # None unless codec="auto:lossy"
    placements = placement_candidates(requested, topo)    # {} unless placement="auto"
    common = dict(lossy_error_budget=budget, budget_s=requested.autotune_budget_s,
                  placement=fixed.placement, placements=placements)
    if not topo.distributed or topo.ep_size == 1:
        # No exchange to tune: every algorithm is a no-op, r only adds chunking, a codec
        # only adds error.
        choice = TunedChoice(fixed.a2a, fixed.schedule, fixed.pipeline_degree, None, None,
                             layout(topo), codec="none",
                             codec_error=0.0 if budget is not None else None, **common)
        _announce(topo, choice, requested.layer_id, x.shape[0],
                  f"{label}, {x.shape[0]} tokens: one expert-parallel rank, nothing to tune: "
                  f"{choice.settings()}")
        return choice
    algos = candidate_algorithms(requested, topo)
    schedules = list(SCHEDULES) if requested.schedule == AUTO else [requested.schedule]
    degrees = list(DEGREES) if requested.pipeline_degree == AUTO else [requested.pipeline_degree]
    x = x.detach().requires_grad_(x.requires_grad)   # same backward as the real step
    measured: list[dict] = []
    errors: dict[str, float] = {}

    def elapsed() -> str:
        return f"({time.perf_counter() - t0:.1f} s)"

    def record(cfg: MoEConfig, pred, stage: str, reps=reps, warmup=None) -> dict | None:
        sec = _measure(layer, cfg, x, reps, clock, warmup)
        if sec is None:
            return None
        m = {"placement": cfg.placement, "codec": cfg.codec, "a2a": cfg.a2a,
             "schedule": cfg.schedule,
             "pipeline_degree": cfg.pipeline_degree,
             "predicted_ms": None if pred is None else 1e3 * pred, "measured_ms": 1e3 * sec,
             "stage": stage}
        measured.append(m)
        return m

    with _Preserved(layer), torch.enable_grad():
        layer._tuning = True
        try:
            base = fixed.replace(schedule="sequential", pipeline_degree=1)
            # 1. screen at r = 1, sequential: the placeholder's algorithm (direct) lossless
            #    first; with codec="auto:lossy" then every lossy codec on it, gentlest first,
            #    each one's warm-up step measuring its error (ErrorProbe; over budget: not
            #    timed); with placement="auto" then node_dedup (DEDUP_ROUTE) where it can
            #    run; then the other algorithms, lossless
            first = fixed.a2a if fixed.a2a in algos else algos[0]
            algos = [first] + [a for a in algos if a != first]
            lossless = "none" if budget is not None else fixed.codec
            probe = ErrorProbe(layer, x) if budget is not None else None
            lossy = (gentlest_first(lossy_candidates(x.dtype, x.device), x.shape[-1], x.dtype)
                     if budget is not None else [])
            budgeted = requested.autotune_budget_s is not None
            dedup = [DEDUP_ROUTE] if placements.get("node_dedup") == "candidate" else []
            for p, why in placements.items():
                if why != "candidate":
                    _say(topo, f"{label}: placement {p} {why}")
            order = screen_order(lossless, first, lossy, algos[1:], schedules, degrees,
                                 budgeted, dedup)
            screen: dict[tuple[str, str], float] = {}    # even one pair: the step estimate
            floor = always_measured(order)
            i = 0
            while i < len(order):
                kind, c, a = order[i]
                left = len(order) - i
                if measured and i != floor and not clock.fits(2):
                    # cut, but for the first overlap trial when still ahead (always_measured)
                    rest = [e for j, e in enumerate(order[i:], i) if j != floor]
                    clock.note_cut(f"screen: {len(rest)} of {len(order)} unscreened "
                                   f"({', '.join(_entry(e) for e in rest)})")
                    if floor is None or floor < i:
                        break
                    order, floor = order[:i] + [order[floor]], i
                    continue
                pos, i = i, i + 1
                # the repetitions adapt: 1 when the budget cannot hold them all
                n = reps if not measured or clock.fits((1 + reps) * left) else 1
                if kind == "overlap":       # (schedule, r) on the best pair screened so far
                    bc, ba = min(screen, key=screen.get)
                    m = record(concrete(fixed, bc, ba, c, a), None, "overlap", n)
                    if n < reps:
                        clock.note_cut(f"overlap {bc}/{ba}/{c}/r={a}: 1 of {reps} reps")
                    _say(topo, f"{label}: screen {pos + 1}/{len(order)} codec={bc} a2a={ba} "
                               f"schedule={c} r={a}: {m['measured_ms']:.1f} ms {elapsed()}")
                    continue
                warm = None
                if probe is not None and c == lossless and pos == 0:
                    warm = lambda: (probe.reference(), True)[1]          # noqa: E731
                elif probe is not None and c != lossless:
                    def warm(c=c):
                        errors[c] = probe.error()
                        return errors[c] <= budget                       # NaN: dropped
                m = record(concrete(base, c, a), None, "screen", n, warm)
                if m is None:
                    _say(topo, f"{label}: screen {pos + 1}/{len(order)} codec={c}: error "
                               f"{errors[c]:.2e} over budget {budget:g}, not timed "
                               f"{elapsed()}")
                    continue
                if n < reps:
                    clock.note_cut(f"screen {c}/{a}: 1 of {reps} reps")
                screen[(c, a)] = m["measured_ms"]
                err = f", error {errors[c]:.2e}" if c in errors else ""
                _say(topo, f"{label}: screen {pos + 1}/{len(order)} codec={c} a2a={a} r=1: "
                           f"{screen[(c, a)]:.1f} ms{err} {elapsed()}")
            dedup_ok = True
            if (lossless, DEDUP_ROUTE) in screen and (lossless, first) in screen:
                dedup_ok = _paired_placement(layer, x, clock, measured, screen,
                                             concrete(base, lossless, first),
                                             concrete(base, lossless, DEDUP_ROUTE))
                _say(topo, f"{label}: paired screen direct vs node_dedup: "
                           f"{screen[(lossless, first)]:.1f} vs "
                           f"{screen[(lossless, DEDUP_ROUTE)]:.1f} ms (medians), node_dedup "
                           f"{'kept' if dedup_ok else 'dropped'} {elapsed()}")
            kept = sorted(screen, key=screen.get)[:KEEP_ALGOS]
            # 2. ScheMoE's profiler + chooser on the kept (codec, algorithm) pairs, cut to
            #    one pair, then skipped, when the budget cannot hold it
            cands = []
            profile_steps = len(degrees) * (1 + reps)
            if schedules == ["sequential"] and degrees == [1]:
                # every candidate is a screened pair at r = 1, sequential: nothing to predict
                plan = []
            else:
                plan = next((p for p in (kept, kept[:1])
                             if not measured or clock.fits(len(p) * profile_steps)), None)
            if plan is None:
                clock.note_cut("profile: skipped")
            elif plan:
                if len(plan) < len(kept):
                    clock.note_cut(f"profile: {len(plan)} of {len(kept)} pairs")
                for c, a in plan:
                    _, more, _ = choose(
                        lambda codec, a2a: (apply(layer, concrete(base, codec, a2a)), layer)[1],
                        x, [c], [a], degrees, schedules, reps=reps)
                    cands += more
                cands.sort(key=lambda c: c.predicted_s)
                _say(topo, f"{label}: profiled {plan} at r={degrees}, {len(cands)} candidates "
                           f"predicted {elapsed()}")
            # 3. measure the best predictions (fallback without predictions: the overlapping
            #    schedules of the best screened pair), skipping what was measured already
            trial = []
            for c in cands:
                key = _key(c)
                if key not in [k for k, _ in trial]:
                    trial.append((key, c.predicted_s))
                if len(trial) == MEASURE_TOP:
                    break
            if plan is None and screen:
                trial = _fallback_trials(min(screen, key=screen.get), schedules, degrees)
            done = {_key(m) for m in measured}
            trial = [t for t in trial if t[0] not in done]
            for i, ((c, a, s, r), pred) in enumerate(trial):
                if measured and not clock.fits(2):
                    clock.note_cut(f"measure: {len(trial) - i} of {len(trial)} unmeasured")
                    break
                m = record(concrete(fixed, c, a, s, r), pred, "measure")
                p = "-" if pred is None else f"{1e3 * pred:.1f} ms"
                _say(topo, f"{label}: measure {i + 1}/{len(trial)} codec={c} a2a={a} "
                           f"schedule={s} r={r}: predicted {p}, measured "
                           f"{m['measured_ms']:.1f} ms {elapsed()}")
        finally:
            layer._tuning = False
    win = pick(measured, dedup_ok=dedup_ok)
    pred = win["predicted_ms"]
    if pred is None:      # measured in the screen: the chooser's prediction, where it made one
        pred = next((1e3 * c.predicted_s for c in cands if _key(c) == _key(win)), None)
    err = errors.get(win["codec"], 0.0) if budget is not None else None
    choice = TunedChoice(win["a2a"], win["schedule"], win["pipeline_degree"], pred,
                         win["measured_ms"], layout(topo), tune_s=time.perf_counter() - t0,
                         candidates=measured, codec=win["codec"], codec_error=err,
                         codec_errors=errors, budget_cut=list(clock.cut),
                         max_step_ms=1e3 * clock.max_step_s,
                         **dict(common, placement=win["placement"]))
    p = "-" if pred is None else f"{pred:.1f} ms"
    where = (f"placement={choice.placement} " if requested.placement == AUTO else "")
    lossy = "" if err is None else f" (error {err:.2e}, budget {budget:g})"
    cut = (f"; time budget {requested.autotune_budget_s:g} s cut: {'; '.join(clock.cut)}"
           if clock.cut else "")
    _announce(topo, choice, requested.layer_id, x.shape[0],
              f"{label}, {x.shape[0]} tokens: chose {where}codec={choice.codec}{lossy} "
              f"a2a={choice.a2a} schedule={choice.schedule} r={choice.pipeline_degree} "
              f"({choice.measured_ms:.1f} ms measured, {p} predicted, {len(measured)} "
              f"candidates) in {choice.tune_s:.1f} s{cut}")
    return choice


def tuning_state(model: torch.nn.Module) -> dict[str, dict]:
    """The tuned choices of every auto-tuned MoE layer in ``model``, by module name (what a
    checkpoint stores so that a resume does not re-tune)."""
    return {name: m.tuned.as_dict() for name, m in model.named_modules()
            if getattr(m, "auto_fields", None) and getattr(m, "tuned", None) is not None}


def restore_tuning(model: torch.nn.Module, state: dict[str, dict]) -> list[str]:
    """Fix the saved choices in the layers of ``model`` that were measured on the same
    topology (others re-tune at their next forward); returns the names restored."""
    done = []
    modules = dict(model.named_modules())
    for name, d in state.items():
        m = modules.get(name)
        if m is None or not getattr(m, "auto_fields", None):
            continue
        choice = TunedChoice.from_dict(d)
        budget = m.requested_cfg.effective_lossy_error_budget
        # a choice saved before placement="auto" existed did not measure node_dedup
        if choice.topology == layout(m.topo) and (
                "codec" not in m.auto_fields or choice.lossy_error_budget == budget) and (
                "placement" not in m.auto_fields or "placement" in d):
            m.set_tuned(choice)
            done.append(name)
    return done
