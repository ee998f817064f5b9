"""Auto-tuning of a layer's all-to-all algorithm, schedule and pipelining degree (issue 18).

``MoEConfig(a2a="auto", schedule="auto", pipeline_degree="auto")`` (any subset) leaves the
choice to the running cluster, as ScheMoE's profiler + scheduler do (ScheMoE section 3.2 and
section 4: the task profiler fits per-task models, the two-lane model of section 4.1 predicts
each (r, schedule), Theorem 1's OptSche is among the candidates). At the layer's first forward
(or :meth:`moeflow.layer.MoELayer.tune`), collectively on every rank of the layer:

1. Screen: time every usable all-to-all algorithm (``check_topology`` passes) at r = 1,
   sequential (1 warm-up + ``reps`` steps, each the slowest rank's time); keep the best two.
2. Profile + predict: :func:`moeflow.schedule.chooser.choose` profiles those at r in
   ``DEGREES`` and predicts every (algorithm, schedule, r) candidate.
3. Measure: the ``MEASURE_TOP`` best predictions and the screen's winner are run (1 warm-up +
   ``reps`` steps); the fastest *measured* median wins. Every timing is the maximum over ranks
   (a host all-reduce), so every rank computes the same numbers and fixes the same choice.

Only the exchange is tuned: the codec stays the config's (lossless ``none`` by default), since
lossy codecs change the function and are never picked automatically. Tuning changes speed
only: the layer's parameters, gradients and random state are as before it, and the real
forward that follows runs with the chosen settings (float64 parity in tests/test_autotune.py).

Re-tuning: the layer records the rows its EP group sends per forward (the count matrix, known
to every rank of the group); every ``layer.retune_check_every`` (default
``RETUNE_CHECK_EVERY``) training forwards, all ranks agree in one host all-reduce whether any
group's rows differ by more than ``RETUNE_RATIO`` from the rows at tuning time, and if so
they re-tune together (EP groups may see different rows: deciding alone could leave a rank
waiting in the tuner's collectives).

The cost is bounded by construction: ``(algorithms x (1 + reps)) + 2 x choose's profile steps +
(MEASURE_TOP + 1) x (1 + reps)`` forward + backward steps; each stage logs a line (logger
``moeflow.autotune``, rank 0) with its elapsed time.
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from moeflow.config import AUTO, MoEConfig

log = logging.getLogger("moeflow.autotune")

AUTO_FIELDS = ("a2a", "schedule", "pipeline_degree")
SCHEDULES = ("sequential", "pipelined", "optsche")
DEGREES = (1, 2, 4)
KEEP_ALGOS = 2          # algorithms kept after the screen
MEASURE_TOP = 3         # predicted candidates measured before the final choice
RETUNE_RATIO = 2.0      # re-tune when the rows per forward change by more than this factor
RETUNE_CHECK_EVERY = 50  # training forwards between the collective re-tune checks


@dataclass
class TunedChoice:
    """What the tuner fixed, with its prediction and measurement (milliseconds, forward +
    backward of the layer, slowest rank), and the topology it was measured on."""

    a2a: str
    schedule: str
    pipeline_degree: int
    predicted_ms: float | None        # None where nothing was predicted (one rank)
    measured_ms: float | None
    topology: str                     # layout(topo): a resume on another layout re-tunes
    rows: int | None = None           # rows sent per forward over the EP group when tuned
    tune_s: float = 0.0               # wall time the tuning took
    candidates: list[dict] = field(default_factory=list)   # every measured candidate

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TunedChoice":
        return cls(**d)

    def settings(self) -> dict:
        return {"a2a": self.a2a, "schedule": self.schedule,
                "pipeline_degree": self.pipeline_degree}


def layout(topo) -> str:
    """The topology without this rank's position: equal on every rank of a job."""
    return re.sub(r"\brank=\d+, ", "", repr(topo))


def auto_fields(cfg: MoEConfig) -> tuple[str, ...]:
    """The fields of ``cfg`` left to the tuner."""
    return tuple(f for f in AUTO_FIELDS if getattr(cfg, f) == AUTO)


def placeholder(cfg: MoEConfig) -> MoEConfig:
    """``cfg`` with its auto fields set to the untuned defaults (direct, sequential, r = 1),
    used until the first forward tunes them."""
    defaults = {"a2a": "direct", "schedule": "sequential", "pipeline_degree": 1}
    return cfg.replace(**{f: defaults[f] for f in auto_fields(cfg)})


def retune_agreed(layer) -> bool:
    """Whether to re-tune now, decided by every rank together: each
    ``layer.retune_check_every``-th training forward, one host all-reduce (max) of each rank's
    :func:`needs_retune` flag over the world. The rows are those of the rank's own EP group, so
    two EP groups can see different rows; agreeing first means no rank enters the (collective)
    tuning alone, and between checks there is no extra message."""
    from moeflow.bench.timing import slowest

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
        try:
            cls.check_topology(topo)
        except ConfigError:
            continue
        ok.append(name)
    if topo.esp_size > 1:
        from moeflow.parallel.parm.checks import ESP_ALLTOALLS
        ok = [a for a in ok if a in ESP_ALLTOALLS]
    return ok


class _Preserved:
    """Save and restore what a tuning run must not change: gradients, RNG states, the
    layer's timer / timeline and its last forward's aux_loss and stats."""

    def __init__(self, layer):
        self.layer = layer

    def __enter__(self):
        L = self.layer
        self.grads = {id(p): p.grad for p in L.parameters()}
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.state = (L.cfg, L.algo, L.scheduler, L.timer, L.timeline, L.aux_loss,
                      dict(L._stats))
        L.timer, L.timeline = None, None
        return self

    def __exit__(self, *exc):
        L = self.layer
        for p in L.parameters():
            p.grad = self.grads.get(id(p))
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        (L.cfg, L.algo, L.scheduler, L.timer, L.timeline, L.aux_loss, stats) = self.state
        L._stats = stats
        return False


def apply(layer, cfg: MoEConfig) -> None:
    """Run ``layer`` with the concrete settings of ``cfg`` (algorithm and scheduler rebuilt
    only when they change)."""
    from moeflow.comm.alltoall import ALLTOALLS
    from moeflow.schedule import SCHEDULERS

    if cfg.a2a != layer.cfg.a2a:
        layer.algo = ALLTOALLS[cfg.a2a](layer.topo)
    if cfg.schedule != layer.cfg.schedule:
        layer.scheduler = SCHEDULERS[cfg.schedule]()
    layer.cfg = cfg


def _measure(layer, cfg: MoEConfig, x: torch.Tensor, reps: int) -> float:
    """Median seconds of ``reps`` forward + backward steps (after one warm-up), each step the
    slowest rank's: the same number on every rank."""
    from moeflow.bench.timing import time_aligned

    def step():
        y = layer(x)
        (y.float().square().mean() + layer.aux_loss).backward()

    apply(layer, cfg)
    times = []
    for _ in range(1 + reps):
        times.append(time_aligned(step, layer.topo, x.device))
        layer.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def log_to_stderr() -> None:
    """Show the tuner's progress lines on stderr (``moeflow train`` does this on rank 0)."""
    if not any(getattr(h, "moeflow_autotune", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.moeflow_autotune = True
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def _say(topo, msg: str) -> None:
    if topo.rank == 0:
        log.info(msg)


def tune(layer, x: torch.Tensor, requested: MoEConfig, reps: int = 2,
         name: str = "") -> TunedChoice:
    """Choose the auto fields of ``requested`` for ``layer`` on input ``x`` (collective over
    every rank of the layer's topology; all ranks must call it together)."""
    from moeflow.schedule.chooser import choose

    topo, t0 = layer.topo, time.perf_counter()
    label = f"autotune {name or 'layer'} (layer_id {requested.layer_id})"
    fixed = placeholder(requested)
    if not topo.distributed or topo.ep_size == 1:
        # No exchange to tune: every algorithm is a no-op and r only adds chunking.
        choice = TunedChoice(fixed.a2a, fixed.schedule, fixed.pipeline_degree, None, None,
                             layout(topo))
        _say(topo, f"{label}: one expert-parallel rank, nothing to tune: {choice.settings()}")
        return choice
    algos = candidate_algorithms(requested, topo)
    schedules = list(SCHEDULES) if requested.schedule == AUTO else [requested.schedule]
    degrees = list(DEGREES) if requested.pipeline_degree == AUTO else [requested.pipeline_degree]
    x = x.detach().requires_grad_(x.requires_grad)   # same backward as the real step
    measured: list[dict] = []
    with _Preserved(layer), torch.enable_grad():
        layer._tuning = True
        try:
            # 1. screen the algorithms at r = 1, sequential
            base = fixed.replace(schedule="sequential", pipeline_degree=1)
            screen = {}
            if len(algos) > 1:
                for i, a in enumerate(algos):
                    screen[a] = _measure(layer, base.replace(a2a=a), x, reps)
                    _say(topo, f"{label}: screen {i + 1}/{len(algos)} a2a={a} r=1: "
                               f"{screen[a] * 1e3:.1f} ms ({time.perf_counter() - t0:.1f} s)")
                kept = sorted(algos, key=screen.get)[:KEEP_ALGOS]
            else:
                kept = algos
            # 2. ScheMoE's profiler + chooser on the kept algorithms
            best, cands, _ = choose(
                lambda codec, a2a: (apply(layer, base.replace(codec=codec, a2a=a2a)), layer)[1],
                x, [requested.codec], kept, degrees, schedules, reps=reps)
            _say(topo, f"{label}: profiled {kept} at r={degrees}, {len(cands)} candidates "
                       f"predicted ({time.perf_counter() - t0:.1f} s)")
            # 3. measure the best predictions (and the screen's winner at r = 1)
            trial = []
            for c in cands:
                key = (c.a2a, c.schedule, c.pipeline_degree)
                if key not in [k for k, _ in trial]:
                    trial.append((key, c.predicted_s))
                if len(trial) == MEASURE_TOP:
                    break
            key = (kept[0], "sequential", 1)
            if screen and key not in [k for k, _ in trial]:
                pred = next((c.predicted_s for c in cands
                             if (c.a2a, c.schedule, c.pipeline_degree) == key), None)
                if pred is not None:
                    trial.append((key, pred))
            for i, ((a, s, r), pred) in enumerate(trial):
                cfg = fixed.replace(a2a=a, schedule=s, pipeline_degree=r)
                ms = 1e3 * _measure(layer, cfg, x, reps)
                measured.append({"a2a": a, "schedule": s, "pipeline_degree": r,
                                 "predicted_ms": 1e3 * pred, "measured_ms": ms})
                _say(topo, f"{label}: measure {i + 1}/{len(trial)} a2a={a} schedule={s} r={r}: "
                           f"predicted {1e3 * pred:.1f} ms, measured {ms:.1f} ms "
                           f"({time.perf_counter() - t0:.1f} s)")
        finally:
            layer._tuning = False
    win = min(measured, key=lambda m: (m["measured_ms"], m["pipeline_degree"]))
    choice = TunedChoice(win["a2a"], win["schedule"], win["pipeline_degree"],
                         win["predicted_ms"], win["measured_ms"], layout(topo),
                         tune_s=time.perf_counter() - t0, candidates=measured)
    _say(topo, f"{label}: chose a2a={choice.a2a} schedule={choice.schedule} "
               f"r={choice.pipeline_degree}: predicted {choice.predicted_ms:.1f} ms, measured "
               f"{choice.measured_ms:.1f} ms; tuning took {choice.tune_s:.1f} s")
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
        if choice.topology == layout(m.topo):
            m.set_tuned(choice)
            done.append(name)
    return done
