"""Rank bodies of tests/multirank/test_autotune_lossy.py (``worker``, ``cut_sweep_worker``) and
tests/multirank/test_autotune_clock.py (``clock_worker``), importable by spawned ranks; float64
inputs on 2 gloo ranks: codec="auto:lossy" at budget 0 (as timed, and with the step times and
the time budget's cut forced so that the tuner picks r = 2; slow: cut at every point in turn)
and at a generous budget, its checkpoint round-trip, a tuning cut short by a tiny time budget,
and one under a budget that holds everything."""

from __future__ import annotations

import torch

from moeflow import MoEConfig, MoELayer, Topology, checkpoint
from moeflow import autotune
from moeflow.autotune.clock import TuneClock
from moeflow.measure import timing

EXCHANGE_AUTO = dict(a2a="auto", schedule="auto", pipeline_degree="auto")


def _config(**kw) -> MoEConfig:
    return MoEConfig(d_model=8, d_expert=12, num_experts=4, top_k=2, capacity_factor=1.25,
                     seed=3, gate_noise=0.1, **kw)


def _step(layer: MoELayer, x: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(5)                                 # gate noise: same draws everywhere
    y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()
    return {"y": y.detach(), "dx": x.grad,
            **{n: p.grad.clone() for n, p in layer.named_parameters()}}


def _pair(topo: Topology, x: torch.Tensor, **auto) -> dict:
    """An auto layer's first step, and the fixed layer with the settings it chose."""
    layer = MoELayer(_config(**auto), topo).train()
    got = _step(layer, x)
    t = layer.tuned
    fixed = MoELayer(_config(codec=t.codec, a2a=t.a2a, schedule=t.schedule,
                             pipeline_degree=t.pipeline_degree), topo).train()
    return {"layer": layer, "got": got, "ref": _step(fixed, x), "choice": t.as_dict(),
            "stats": layer.stats, "codec_class": type(layer.codec).__name__,
            "fixed_codec_class": type(fixed.codec).__name__}


def worker(ckpt_dir: str) -> dict:
    torch.set_default_dtype(torch.float64)
    topo = Topology.from_env()
    calls = []
    real_tune = autotune.tune

    def counting_tune(*a, **kw):
        calls.append(a[1].shape[0])
        return real_tune(*a, **kw)

    autotune.tune = counting_tune
    gen = torch.Generator().manual_seed(10 + topo.rank)
    x = torch.randn(24 + 3 * topo.rank, 8, generator=gen)
    out = {}
    zero = _pair(topo, x, codec="auto:lossy", lossy_error_budget=0.0, **EXCHANGE_AUTO)
    plain = MoELayer(_config(), topo).train()            # direct / sequential / 1 / none
    out["zero"] = {k: zero[k] for k in ("got", "ref", "choice")} | {"plain": _step(plain, x)}
    out["zero_forced"] = _forced_overlap_pick(topo, x) | {"plain": out["zero"]["plain"]}
    wide = _pair(topo, x, codec="auto:lossy", lossy_error_budget=1.0)
    out["wide"] = {k: v for k, v in wide.items() if k != "layer"}
    # checkpoint round-trip: the same budget restores the codec; another budget re-tunes
    checkpoint.save(ckpt_dir, wide["layer"], torch.optim.AdamW(wide["layer"].parameters()), 1)
    resumed = MoELayer(_config(codec="auto:lossy", lossy_error_budget=1.0), topo)
    checkpoint.load(ckpt_dir, resumed, torch.optim.AdamW(resumed.parameters()))
    n = len(calls)
    after = _step(resumed, x)
    out["resume"] = {"calls": len(calls) - n, "codec": resumed.tuned.codec,
                     "codec_class": type(resumed.codec).__name__,
                     "y_equal": bool(torch.equal(after["y"], wide["got"]["y"]))}
    other = MoELayer(_config(codec="auto:lossy", lossy_error_budget=0.5), topo)
    checkpoint.load(ckpt_dir, other, torch.optim.AdamW(other.parameters()))
    n = len(calls)
    _step(other, x)
    out["other_budget_calls"] = len(calls) - n
    return out


# the one setting the forced timings make fastest: the budgeted screen's first overlap trial
# (the largest pipelining degree, tuner.overlap_trials)
FORCED = ("direct", "optsche", 4)


def _forced_overlap_pick(topo: Topology, x: torch.Tensor, answers: int | None = None) -> dict:
    """The budget-0 ``auto:lossy`` layer's first step with the tuner's clock forced, as a
    loaded machine can make it: every timed step takes 1 ms but ``FORCED``'s 0.5 ms, and the
    time budget holds every question until a step at r > 1 has run, then none (the screen is
    cut right after its first overlap trial, as under load). Every lossy codec is probed
    (budget 0: none is timed) before the cut; the tuner must pick ``FORCED`` with codec
    ``none``. ``answers``: instead, the budget holds the first ``answers`` questions and
    no later one (every cut point of the tuning in turn, :func:`cut_sweep_worker`). No timing
    decides anything here."""
    layer = MoELayer(_config(codec="auto:lossy", lossy_error_budget=0.0, **EXCHANGE_AUTO),
                     topo).train()
    overlapped, asked = [False], [0]

    def forced_time(fn, topo, device):
        fn()
        cfg = layer.cfg
        overlapped[0] |= cfg.pipeline_degree > 1
        return 5e-4 if (cfg.a2a, cfg.schedule, cfg.pipeline_degree) == FORCED else 1e-3

    def forced_fits(clock, steps):
        asked[0] += 1
        return not overlapped[0] if answers is None else asked[0] <= answers

    real_time, real_fits = timing.time_aligned, TuneClock.fits
    timing.time_aligned, TuneClock.fits = forced_time, forced_fits
    try:
        got = _step(layer, x)
    finally:
        timing.time_aligned, TuneClock.fits = real_time, real_fits
    t = layer.tuned
    chosen = MoELayer(_config(codec=t.codec, a2a=t.a2a, schedule=t.schedule,
                              pipeline_degree=t.pipeline_degree), topo).train()
    return {"got": got, "ref": _step(chosen, x), "choice": t.as_dict()}


def cut_sweep_worker() -> dict:
    """The forced budget-0 tuning (:func:`_forced_overlap_pick`) cut after each number of the
    time budget's questions in turn, from none answered to a tuning nothing cut: by
    answers, its step, the chosen settings' step and the choice; with the untuned step."""
    torch.set_default_dtype(torch.float64)
    topo = Topology.from_env()
    gen = torch.Generator().manual_seed(10 + topo.rank)
    x = torch.randn(24 + 3 * topo.rank, 8, generator=gen)
    out = {"plain": _step(MoELayer(_config(), topo).train(), x), "cuts": {}}
    for answers in range(100):
        run = _forced_overlap_pick(topo, x, answers)
        out["cuts"][answers] = run
        if not run["choice"]["budget_cut"]:
            break
    return out


def clock_worker() -> dict:
    """A tiny time budget: cut short, still one valid choice on every rank; and unbounded."""
    torch.set_default_dtype(torch.float64)
    topo = Topology.from_env()
    gen = torch.Generator().manual_seed(10 + topo.rank)
    x = torch.randn(24 + 3 * topo.rank, 8, generator=gen)
    out = {}
    tiny = _pair(topo, x, autotune_budget_s=1e-3, **EXCHANGE_AUTO)
    out["tiny"] = {k: v for k, v in tiny.items() if k != "layer"}
    some = _pair(topo, x, autotune_budget_s=0.5, **EXCHANGE_AUTO)
    out["some"] = {"choice": some["choice"]}
    free = _pair(topo, x, autotune_budget_s=None, **EXCHANGE_AUTO)
    out["free"] = {"choice": free["choice"]}
    # a budget that holds everything: the overlap trials run early, nothing is cut
    roomy = _pair(topo, x, autotune_budget_s=120.0, **EXCHANGE_AUTO)
    out["roomy"] = {k: roomy[k] for k in ("choice", "got", "ref")}
    return out
