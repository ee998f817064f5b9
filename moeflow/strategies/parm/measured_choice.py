"""Algorithm 1's choice confirmed by measurement (``MoEConfig.parm_auto_measure``; beyond the
Parm paper, which picks from the alpha-beta fits of Section V-A alone).

Algorithm 1 (Section V-B, :mod:`.algorithm1`) predicts each candidate's communication from
fits of each collective timed alone, without the experts' computation; what each extra chunk
of the pipelined ted and each smaller GEMM costs on a rank is in none of its terms. So at the
layer's first training call (:func:`confirm`), before the call proceeds, the candidates are
timed in the layer's own context: each forced (:attr:`.algorithm1.AutoSchedule.forced`) for
one warm-up and :data:`TIMED_STEPS` forward + backward steps of this layer on this call's
input, best predicted first, each step the slowest rank's
(:func:`moeflow.measure.timing.time_aligned`), within the layer's tuning budget
(``MoEConfig.autotune_budget_s``: a candidate after the first is measured only while the
budget holds its steps; Algorithm 1's own choice always is).

Where the two fastest lie within :data:`PAIRED_MARGIN` of each other, they are timed again in
:data:`PAIRED_STEPS` interleaved pairs (:func:`moeflow.measure.timing.paired_times`, as the
auto-tuner's placement screen; while the budget holds each pair), so that a slow spell of a
shared machine falls on both; each one's time is then the median of all its timed steps.

Afterwards Algorithm 1 still predicts per call (the token count may change), and
:class:`Calibration` weighs only the measured candidates, each prediction multiplied by that
candidate's measured / predicted ratio at the confirming call: at the confirming call's own
``(tokens, k, f)`` this is the measured time, so the measured fastest is taken; elsewhere the
prediction's scaling with the tokens is kept. Every time is the slowest rank's and every
prediction agreed over the ranks, so every rank takes the same decisions and runs the same
collectives in the same order.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

from moeflow.strategies.parm.ted_pipelined import pipelined_name

log = logging.getLogger("moeflow.parm")

#: forward + backward steps timed per candidate, after one warm-up step
TIMED_STEPS = 2
#: the two fastest are re-timed in interleaved pairs when the second is within this fraction
PAIRED_MARGIN = 0.10
#: interleaved pairs of the two fastest (one step each, both already warm)
PAIRED_STEPS = 3


def predicted_times(pred) -> dict[str, float]:
    """A :class:`.algorithm1.Prediction`'s seconds per candidate it weighed, in lines 6-9's
    order of preference on a tie (S1, S2, ted, the pipelined ted by chunks)."""
    times = {"s1": pred.t_d1, "s2": pred.t_d2}
    if pred.t_ted is not None:
        times["ted"] = pred.t_ted
    times.update((pipelined_name(r), t) for r, t in pred.t_ted_pipelined)
    return times


def predicted_order(pred) -> list[str]:
    """The candidates best predicted first (ties in :func:`predicted_times`' order, so the
    first is Algorithm 1's choice)."""
    times = predicted_times(pred)
    return sorted(times, key=times.get)


@dataclass(frozen=True)
class Calibration:
    """The confirming call's measurements: ``measured_s`` each measured candidate's median
    step (seconds, the slowest rank's), ``predicted_s`` Algorithm 1's prediction for it at
    that call."""
    measured_s: dict[str, float]
    predicted_s: dict[str, float]

    def times(self, pred) -> dict[str, float]:
        """The measured candidates' calibrated times for prediction ``pred``: each
        prediction times its measured / predicted ratio (the measured time where the
        confirming call predicted 0); the unmeasured candidates are not weighed."""
        now = predicted_times(pred)
        return {c: (self.measured_s[c] * t / self.predicted_s[c] if self.predicted_s[c] > 0
                    else self.measured_s[c])
                for c, t in now.items() if c in self.measured_s}

    def choose(self, pred) -> str:
        """The least calibrated time (the earlier candidate on a tie); Algorithm 1's own
        choice where none of the measured candidates is weighed by ``pred``."""
        times = self.times(pred)
        return min(times, key=times.get) if times else pred.schedule


def close_pair(measured: dict[str, float]) -> tuple[str, str] | None:
    """The two fastest measured candidates when the second is within :data:`PAIRED_MARGIN` of
    the first (2 timed steps each cannot tell them apart on a shared machine: on the emulated
    cluster one such pair measured 128 against 134 ms); None otherwise."""
    if len(measured) < 2:
        return None
    first, second = sorted(measured, key=measured.get)[:2]
    return (first, second) if measured[second] <= measured[first] * (1 + PAIRED_MARGIN) else None


def confirm(layer, auto, x: torch.Tensor, top_k, capacity_factor, clock, preserved) -> None:
    """Time Algorithm 1's candidates on ``layer`` with this call's input and options, then
    give ``auto`` (the layer's :class:`.algorithm1.AutoSchedule`) its :class:`Calibration`
    (collective: every rank calls it at the same call). ``clock``: a
    :class:`~moeflow.autotune.clock.TuneClock` over the layer's ``autotune_budget_s``;
    ``preserved``: a context manager that puts back gradients, RNG states, the last
    forward's aux loss and stats, timer and timeline
    (:class:`~moeflow.autotune.settings._Preserved`). The Algorithm 1 state the steps touch
    (the last prediction and choice, the kept fraction) is put back too."""
    from moeflow.measure.timing import layer_step, paired_times, time_aligned

    t0 = time.perf_counter()
    k, factor = layer.cfg.per_call(top_k, capacity_factor)
    tokens = x.numel() // layer.cfg.d_model
    last, kept, choice = auto.last, auto.kept, auto.choice
    # this call's prediction, agreed over the ranks (measures the fits on a first call)
    layer.strategy.parts.choose(layer, tokens, k, factor)
    pred = auto.last
    order = predicted_order(pred)
    x = x.detach().requires_grad_(x.requires_grad)       # the real step's backward, no further

    def one_step(cand: str, estimate: bool = True) -> float:
        """One timed step of ``cand`` (the slowest rank's seconds); a warm-up is no estimate
        of the next steps' length for the budget."""
        auto.forced = cand
        t = time_aligned(lambda: layer_step(layer, x, top_k=top_k,
                                            capacity_factor=capacity_factor),
                         layer.topo, x.device)
        clock.note_step(t, estimate=estimate)
        layer.zero_grad(set_to_none=True)
        return t

    samples, cut = {}, []                      # each candidate's timed steps (seconds)
    with preserved, torch.enable_grad():
        layer._tuning = True                   # the steps neither tune nor confirm again
        layer.zero_grad(set_to_none=True)      # the caller's gradients are put back after
        try:
            for i, cand in enumerate(order):
                if i > 0 and not clock.fits(1 + TIMED_STEPS):    # the same on every rank
                    cut = order[i:]
                    break
                samples[cand] = [one_step(cand, estimate=s > 0)
                                 for s in range(1 + TIMED_STEPS)][1:]
            # the same on every rank (the slowest ranks' times)
            paired = close_pair({c: statistics.median(t) for c, t in samples.items()})
            if paired and clock.fits(2):
                a, b = paired_times(lambda: one_step(paired[0]), lambda: one_step(paired[1]),
                                    PAIRED_STEPS, clock.fits, warmup=False)
                for cand, more in zip(paired, (a, b)):
                    samples[cand] += more
        finally:
            auto.forced = None
            layer._tuning = False
            auto.last, auto.kept, auto.choice = last, kept, choice
    measured = {c: statistics.median(t) for c, t in samples.items()}
    predicted = predicted_times(pred)
    auto.calibration = Calibration(measured, {c: predicted[c] for c in measured})
    auto.confirm_s, auto.confirm_cut = time.perf_counter() - t0, cut
    if layer.topo.rank == 0:
        log.info("Parm auto, measured confirmation (%d tokens, %.1f s): %s%s; Algorithm 1 "
                 "alone: %s", tokens, auto.confirm_s,
                 ", ".join(f"{c} {1e3 * t:.1f} ms (predicted {1e3 * predicted[c]:.3g} ms)"
                           for c, t in measured.items()),
                 f"; over the budget, not measured: {', '.join(cut)}" if cut else "",
                 pred.schedule)
