"""Parm's Algorithm 1 (Section V-B): pick the better of S1 and S2 from alpha-beta fits.

Lines 1-9, with the correction of line 2 (docs/parm.md): ``T`` is the tokens per expert,
``k f B L / E`` (the paper's ``k f B L M / E`` multiplies by ``M`` twice, since line 3 already
has ``y = E T M N_ESP``). ``B L`` is the tokens of one rank's (MP-replicated) MoE input, ``M``
the exchanged width, ``f`` the capacity factor (1 for dropless: the mean tokens per expert).

* line 4 = Eq. 13: ``t_D1 = 2 (alpha_a2a + beta_a2a y / N_MP) + alpha_ag + beta_ag x``;
* line 5: ``t_D2 = alpha_a2a + beta_a2a y / N_MP + alpha_o + beta_o y`` (Eq. 14 with the
  AllGather inside the overlapped term, which is what ``alpha_o``, ``beta_o`` are fitted to:
  the whole SAA, :mod:`.fits`).

:class:`AutoSchedule` is ``parallel_schedule="auto"``: the fits are measured once per topology
on the running cluster (:func:`.fits.measure_parm_fits`, collective) unless given, at sizes
around the messages of the first call (:func:`.fits.elements_around` of the largest ``B L``
over the ranks, so the line is not extrapolated from much smaller messages), and every
call all-reduces the ranks' predictions (sums), so every rank makes the same choice even when
their batches differ. With ``MoEConfig.equal_rank_tokens`` (every rank's batch has the same
token count, so every rank predicts the same from the same fits) the prediction is agreed once
per distinct ``(tokens, k, f)`` and reused, which also checks the promise. The last prediction
is kept on ``AutoSchedule.last`` and logged (logger ``moeflow.parm``) whenever the choice
changes, for comparison with the measured time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moeflow.config import MoEConfig
from moeflow.devices import host_all_reduce
from moeflow.errors import ConfigError
from moeflow.experts.structure import comm_width
from moeflow.strategies.parm.fits import ParmFits, elements_around, measure_parm_fits
from moeflow.topology import Topology

log = logging.getLogger("moeflow.parm")
_FITS: dict[int, ParmFits] = {}            # measured fits per topology (id), shared by layers


@dataclass(frozen=True)
class Prediction:
    schedule: str          # "s1" or "s2"
    t_d1: float            # seconds, Eq. 13 / line 4
    t_d2: float            # seconds, line 5


def algorithm1(fits: ParmFits, tokens: int, E: int, M: int, k: int, f: float, n_esp: int,
               n_mp: int) -> Prediction:
    """Algorithm 1 for ``tokens = B L`` on one rank."""
    x = tokens * M                                               # line 1
    T = k * f * tokens / E                                       # line 2 (tokens per expert)
    y = E * T * M * n_esp                                        # line 3
    a, ag, o = fits.a2a, fits.ag_mp, fits.overlap
    t_d1 = 2 * (a.alpha + a.beta * y / n_mp) + ag.alpha + ag.beta * x    # line 4 (Eq. 13)
    t_d2 = a.alpha + a.beta * y / n_mp + o.alpha + o.beta * y           # line 5
    return Prediction("s1" if t_d1 <= t_d2 else "s2", t_d1, t_d2)       # lines 6-9


def use_fits(topo: Topology, fits: ParmFits) -> None:
    """Give every ``auto`` layer on ``topo`` these fits (instead of measuring them on its first
    call); e.g. fits measured once by ``moeflow bench parm`` or loaded with
    ``ParmFits.from_json``. Call it on every rank with the same fits."""
    _FITS[id(topo)] = fits


class AutoSchedule:
    """``parallel_schedule="auto"`` for one layer (see the module docstring)."""

    def __init__(self, topo: Topology, fits: ParmFits | None = None):
        self.topo, self.fits = topo, fits
        self.last: Prediction | None = None
        self._known: dict[tuple, Prediction] = {}    # equal_rank_tokens: per (tokens, k, f)

    def choose(self, cfg: MoEConfig, tokens: int, top_k: int, factor: float | None,
               device: torch.device | str = "cpu") -> str:
        f, M = 1.0 if factor is None else float(factor), comm_width(cfg)
        if self.fits is None:
            key = id(self.topo)
            if key not in _FITS:                # collective: every rank measures the same sizes
                most = host_all_reduce([float(tokens)], "max", self.topo.world_group)[0]
                sizes = elements_around(int(most), M, top_k, f, self.topo.esp_size,
                                        self.topo.mp_size)
                _FITS[key] = measure_parm_fits(self.topo, elements=sizes, width=M,
                                               device=device)
            self.fits = _FITS[key]
        if cfg.equal_rank_tokens:
            pred = self._known.get((tokens, top_k, f))
            if pred is None:
                pred = self._known[(tokens, top_k, f)] = self._agree_once(cfg, tokens, top_k,
                                                                          f, M)
        else:
            mine = algorithm1(self.fits, tokens, cfg.num_experts, M, top_k, f,
                              self.topo.esp_size, self.topo.mp_size)
            t1, t2 = host_all_reduce([mine.t_d1, mine.t_d2], "sum", self.topo.world_group)
            n = self.topo.world_size
            pred = Prediction("s1" if t1 <= t2 else "s2", t1 / n, t2 / n)  # the ranks' mean
        if self.last is None or pred.schedule != self.last.schedule:
            log.info("Parm Algorithm 1: %s (predicted t_D1 %.3g s, t_D2 %.3g s)",
                     pred.schedule, pred.t_d1, pred.t_d2)
        self.last = pred
        return pred.schedule

    def _agree_once(self, cfg: MoEConfig, tokens: int, top_k: int, f: float,
                    M: int) -> Prediction:
        """``equal_rank_tokens``: the first call of a key. One all-reduce (max) of the
        predictions and of ``tokens`` and ``-tokens`` (their max and min): the promise holds
        iff they agree, and every rank then computed the same prediction from the same fits
        (taking the max keeps the choice the same on every rank even if given fits differ)."""
        mine = algorithm1(self.fits, tokens, cfg.num_experts, M, top_k, f, self.topo.esp_size,
                          self.topo.mp_size)
        t1, t2, most, neg_least = host_all_reduce(
            [mine.t_d1, mine.t_d2, float(tokens), -float(tokens)], "max",
            self.topo.world_group)
        if most != -neg_least:
            raise ConfigError(
                "MoEConfig.equal_rank_tokens=True is invalid: the ranks called the layer with "
                f"different token counts (from {int(-neg_least)} to {int(most)}), so Parm's "
                "Algorithm 1 cannot skip the all-reduce of its predictions; set "
                "equal_rank_tokens=False, or give every rank batches of the same shape")
        return Prediction("s1" if t1 <= t2 else "s2", t1, t2)
