"""Parm's Algorithm 1 (Section V-B): pick the better of S1 and S2 (and, beyond the paper, the
``ted`` schedule) from alpha-beta fits.

Lines 1-9, with the correction of line 2 (docs/parm.md): ``T`` is the tokens per expert,
``k f B L / E`` (the paper's ``k f B L M / E`` multiplies by ``M`` twice, since line 3 already
has ``y = E T M N_ESP``). ``B L`` is the tokens of one rank's (MP-replicated) MoE input, ``M``
the exchanged width, ``f`` the capacity factor (1 for dropless: the mean tokens per expert).

* line 4 = Eq. 13: ``t_D1 = 2 (alpha_a2a + beta_a2a y / N_MP) + alpha_ag + beta_ag x``;
* line 5: ``t_D2 = alpha_a2a + beta_a2a y / N_MP + alpha_o + beta_o y`` (Eq. 14 with the
  AllGather inside the overlapped term, which is what ``alpha_o``, ``beta_o`` are fitted to:
  the whole SAA, :mod:`.fits`).

Beyond the paper: a third candidate, the ``ted`` schedule (:mod:`.ted`: DeepSpeed-TED's order,
the MP duplicates dropped and each row sent once to its expert's EP rank, then fanned out to
the ESP shards inside their group). With ``z = k f B L M / N_MP`` (one rank's rows after the
drop, ``y / (N_ESP N_MP)``), extending lines 4-5 in Eq. 13's form (Section V-A's alpha-beta
terms, one per collective, from the fits' ``a2a_ep``, ``ag_esp``, ``rs_esp``, ``ag_mp``):
``t_TED = 2 (alpha_ep + beta_ep z) + alpha_ag_esp + beta_ag_esp N_ESP z + alpha_rs_esp +
beta_rs_esp N_ESP z + alpha_ag + beta_ag N_MP z`` (a group of one rank costs nothing). It is
weighed only when the fits have its terms for every group of more than one rank; the choice is
then the least of the three predictions (lines 6-9 with three branches).

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
    schedule: str          # "s1", "s2" or "ted"
    t_d1: float            # seconds, Eq. 13 / line 4
    t_d2: float            # seconds, line 5
    t_ted: float | None = None     # seconds, the ted schedule (beyond the paper); or None


def _pick(t1: float, t2: float, t3: float | None) -> Prediction:
    """Lines 6-9, with the ted schedule as a third branch where it is weighed."""
    best = "s1" if t1 <= t2 else "s2"
    if t3 is not None and t3 < min(t1, t2):
        best = "ted"
    return Prediction(best, t1, t2, t3)


def ted_time(fits: ParmFits, tokens: int, M: int, k: int, f: float, n_esp: int, n_mp: int,
             n_ep: int) -> float | None:
    """``t_TED`` of the module docstring (beyond the Parm paper), or None when the fits lack a
    term it needs."""
    z = k * f * tokens * M / n_mp
    terms = [(fits.a2a_ep, z, 2, n_ep), (fits.ag_esp, n_esp * z, 1, n_esp),
             (fits.rs_esp, n_esp * z, 1, n_esp), (fits.ag_mp, n_mp * z, 1, n_mp)]
    total = 0.0
    for ab, elements, times, group in terms:
        if group == 1:
            continue
        if ab is None:
            return None
        total += times * (ab.alpha + ab.beta * elements)
    return total


def algorithm1(fits: ParmFits, tokens: int, E: int, M: int, k: int, f: float, n_esp: int,
               n_mp: int, n_ep: int | None = None) -> Prediction:
    """Algorithm 1 for ``tokens = B L`` on one rank; with ``n_ep`` (the EP group's size) the
    ted schedule is weighed too where the fits have its terms (beyond the paper)."""
    x = tokens * M                                               # line 1
    T = k * f * tokens / E                                       # line 2 (tokens per expert)
    y = E * T * M * n_esp                                        # line 3
    a, ag, o = fits.a2a, fits.ag_mp, fits.overlap
    t_d1 = 2 * (a.alpha + a.beta * y / n_mp) + ag.alpha + ag.beta * x    # line 4 (Eq. 13)
    t_d2 = a.alpha + a.beta * y / n_mp + o.alpha + o.beta * y           # line 5
    t_ted = None if n_ep is None else ted_time(fits, tokens, M, k, f, n_esp, n_mp, n_ep)
    return _pick(t_d1, t_d2, t_ted)                                     # lines 6-9


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
        self._n_ep: int | None = None                # set per call: ted weighed (choose)

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
        # the ted schedule is weighed where it can run (no codecs, no chunks: checks.check_ted)
        self._n_ep = (self.topo.ep_size if cfg.codec == "none" and cfg.pipeline_degree == 1
                      else None)
        if cfg.equal_rank_tokens:
            pred = self._known.get((tokens, top_k, f))
            if pred is None:
                pred = self._known[(tokens, top_k, f)] = self._agree_once(cfg, tokens, top_k,
                                                                          f, M)
        else:
            mine = algorithm1(self.fits, tokens, cfg.num_experts, M, top_k, f,
                              self.topo.esp_size, self.topo.mp_size, self._n_ep)
            ted = -1.0 if mine.t_ted is None else mine.t_ted     # the same on every rank
            t1, t2, t3 = host_all_reduce([mine.t_d1, mine.t_d2, ted], "sum",
                                         self.topo.world_group)
            n = self.topo.world_size
            pred = _pick(t1 / n, t2 / n, None if ted < 0 else t3 / n)      # the ranks' mean
        if self.last is None or pred.schedule != self.last.schedule:
            log.info("Parm Algorithm 1: %s (predicted t_D1 %.3g s, t_D2 %.3g s, ted %s)",
                     pred.schedule, pred.t_d1, pred.t_d2,
                     "-" if pred.t_ted is None else f"{pred.t_ted:.3g} s")
        self.last = pred
        return pred.schedule

    def _agree_once(self, cfg: MoEConfig, tokens: int, top_k: int, f: float,
                    M: int) -> Prediction:
        """``equal_rank_tokens``: the first call of a key. One all-reduce (max) of the
        predictions and of ``tokens`` and ``-tokens`` (their max and min): the promise holds
        iff they agree, and every rank then computed the same prediction from the same fits
        (taking the max keeps the choice the same on every rank even if given fits differ)."""
        mine = algorithm1(self.fits, tokens, cfg.num_experts, M, top_k, f, self.topo.esp_size,
                          self.topo.mp_size, self._n_ep)
        ted = -1.0 if mine.t_ted is None else mine.t_ted
        t1, t2, t3, most, neg_least = host_all_reduce(
            [mine.t_d1, mine.t_d2, ted, float(tokens), -float(tokens)], "max",
            self.topo.world_group)
        if most != -neg_least:
            raise ConfigError(
                "MoEConfig.equal_rank_tokens=True is invalid: the ranks called the layer with "
                f"different token counts (from {int(-neg_least)} to {int(most)}), so Parm's "
                "Algorithm 1 cannot skip the all-reduce of its predictions; set "
                "equal_rank_tokens=False, or give every rank batches of the same shape")
        return _pick(t1, t2, None if ted < 0 else t3)
