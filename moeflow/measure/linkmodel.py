"""Alpha-beta link models: ``t = alpha + beta * bytes``, fitted from measurements, saved as JSON.

The cost model of Parm (section 4, Eq. 1-12: every collective is ``alpha + beta * volume``) and
of ScheMoE's profiler (section 4.2, linear models of each task's time). ``moeflow bench links``
measures, :func:`fit_alpha_beta` fits, :func:`save_fits` writes and :func:`load_fits` reads.

JSON schema (``"schema": "moeflow.links/1"``)::

    {
      "schema": "moeflow.links/1",
      "command": "moeflow bench links ...", "date": "2026-...Z", "host": "...", "cpus": 2,
      "load": "9.15 8.92 5.83",                 # load averages when the run ended
      "layout": {"nodes": 2, "ranks_per_node": 2, "world": 4},
      "link": {"inter_bw_bps": 1e9} | null,     # the emulator's settings (those that were set)
      "fits": [
        {"group": "intra" | "inter" | "world",
         "op": "p2p" | "all_to_all" | "all_gather" | "reduce_scatter" | "all_reduce",
         "group_size": 2,            # ranks in one group (p2p: 2)
         "concurrent_groups": 2,     # groups of this class running the op at the same time
         "alpha_s": 1.2e-4,          # seconds
         "beta_s_per_byte": 8.4e-9,  # seconds per byte
         "bandwidth_Bps": 1.19e8,    # 1 / beta, bytes per second (null when beta = 0)
         "r2": 0.999,                # coefficient of determination of the fit (time domain)
         "max_rel_err": 0.07,        # max |fit - measured| / measured over the points
         "points": [[bytes, median_seconds], ...]}
      ]
    }

``bytes`` follows the nccl-tests convention: the size of the whole buffer one rank holds (the
all-reduce buffer; the all-to-all send buffer; the all-gather output; the reduce-scatter input;
the message for p2p). ``p2p`` times are one-way (half a ping-pong round trip).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

SCHEMA = "moeflow.links/1"


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float                    # seconds
    beta: float                     # seconds per byte
    group_size: int = 0
    r2: float = math.nan
    max_rel_err: float = math.nan

    def predict(self, nbytes: float) -> float:
        """Predicted seconds for ``nbytes`` (same byte convention as the fit)."""
        return self.alpha + self.beta * nbytes

    @property
    def bandwidth(self) -> float:
        """Bytes per second of the linear term (``1 / beta``)."""
        return math.inf if self.beta <= 0 else 1.0 / self.beta


@dataclass(frozen=True)
class MeasuredCurve:
    """A link's measured times as a curve: linear interpolation between the measured sizes.

    One least-squares line over sizes that span decades is pulled by its largest point: on an
    emulated 2 x 4 cluster at 1 Gbit/s, a 4 MiB world all-to-all took 4x its link bound, and the
    line through it predicted 1 MiB at 3.6x that size's own measured median. ScheMoE's profiler (section 4.2) models each task by
    the measurements around its own size; this does the same with the points ``bench links``
    stored. Below the smallest size: that size's time (latency-bound); above the largest: the
    last segment's slope (``alpha``/``beta`` are the whole-range fit, for reports)."""

    sizes: tuple[float, ...]
    times: tuple[float, ...]
    fit: AlphaBeta

    @property
    def alpha(self) -> float:
        return self.fit.alpha

    @property
    def beta(self) -> float:
        return self.fit.beta

    @property
    def group_size(self) -> int:
        return self.fit.group_size

    def predict(self, nbytes: float) -> float:
        s, t = self.sizes, self.times
        if nbytes <= s[0]:
            return t[0]
        i = next((j for j in range(1, len(s)) if nbytes <= s[j]), len(s) - 1)
        slope = max(0.0, (t[i] - t[i - 1]) / (s[i] - s[i - 1]))
        if nbytes > s[-1]:
            return t[-1] + slope * (nbytes - s[-1])
        return t[i - 1] + slope * (nbytes - s[i - 1])


def fit_alpha_beta(sizes, times, group_size: int = 0) -> AlphaBeta:
    """Ordinary least squares of ``t = alpha + beta * s`` (both coefficients kept >= 0).

    If the unconstrained optimum has a negative coefficient, the best fit with that coefficient
    at 0 is taken. Quality: ``r2`` (time domain, what the fit maximises) and ``max_rel_err``
    (worst relative miss, usually at the small sizes, where alpha dominates).
    """
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if s.shape != t.shape or s.size < 2 or np.any(t <= 0):
        raise ValueError("fit_alpha_beta needs >= 2 points with positive times, "
                         f"got sizes={s.tolist()} times={t.tolist()}")
    a_mat = np.stack([np.ones_like(s), s], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a_mat, t, rcond=None)
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(s * t) / np.sum(s * s))
    elif beta < 0:
        alpha, beta = float(t.mean()), 0.0
    pred = alpha + beta * s
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum((t - pred) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return AlphaBeta(float(alpha), float(beta), group_size, r2,
                     float(np.max(np.abs(pred - t) / t)))


def fit_record(group: str, op: str, group_size: int, concurrent: int,
               points: list[tuple[int, float]]) -> dict:
    """One entry of the JSON ``fits`` list."""
    fit = fit_alpha_beta([p[0] for p in points], [p[1] for p in points], group_size)
    return {"group": group, "op": op, "group_size": group_size,
            "concurrent_groups": concurrent, "alpha_s": fit.alpha,
            "beta_s_per_byte": fit.beta,
            "bandwidth_Bps": fit.bandwidth if fit.beta > 0 else None, "r2": fit.r2,
            "max_rel_err": fit.max_rel_err, "points": [[int(b), float(t)] for b, t in points]}


def save_fits(path: str, fits: list[dict], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"schema": SCHEMA, **meta, "fits": fits}, f, indent=1)
        f.write("\n")


def load_fits(path: str, curves: bool = False
              ) -> dict[tuple[str, str], AlphaBeta | MeasuredCurve]:
    """``{(group, op): AlphaBeta}`` from a ``moeflow bench links --out`` file; with
    ``curves``, a :class:`MeasuredCurve` through each fit's stored points instead (a fit with
    fewer than 2 distinct sizes stays its line)."""
    with open(path) as f:
        data = json.load(f)
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r} is not {SCHEMA!r}; write it "
                         "with `moeflow bench links --out`")
    out = {}
    for r in data["fits"]:
        fit = AlphaBeta(r["alpha_s"], r["beta_s_per_byte"], r.get("group_size", 0),
                        r.get("r2", math.nan), r.get("max_rel_err", math.nan))
        pts = sorted((float(b), float(t)) for b, t in r.get("points", []))
        if curves and len({b for b, _ in pts}) == len(pts) >= 2:
            fit = MeasuredCurve(tuple(b for b, _ in pts), tuple(t for _, t in pts), fit)
        out[(r["group"], r["op"])] = fit
    return out
