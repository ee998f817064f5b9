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

Beyond the paper and DeepSpeed-TED, trimmed capacity (``MoEConfig.capacity_padding``,
:mod:`.padding`): a candidate whose plan sends only the kept rows (S1, ``ted`` and the pipelined
ted, where the call trims) moves ``k f' B L / E`` rows per expert instead of line 2's ``k f B L
/ E``, with ``f' = `` kept rows ``/ (k B L)`` (at most 1, at most ``f``); the candidates that
pad (S2) keep ``f``. The routing of the call is not known when the schedule is chosen (S1
splits the tokens before the gate), so ``f'`` is this layer's last trimmed call's on this rank
(:meth:`AutoSchedule.note_kept`), and before any, balanced routing's ``min(f, 1)``; the
ranks' predictions are then agreed as below, so the choice weighs the mean over the ranks.

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

Beyond the paper, with ``MoEConfig.parm_auto_measure`` (:mod:`.measured_choice`): the layer's
first training call times the candidates in their predicted order (``AutoSchedule.forced``
while each runs: :meth:`AutoSchedule.choose` returns it on every rank without its
all-reduce), and from then on each call's prediction is weighed through the measurements
(``AutoSchedule.calibration``): the call runs ``AutoSchedule.choice``, the measured times are
on ``AutoSchedule.measured``, and ``AutoSchedule.last`` keeps Algorithm 1's own prediction.
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
from moeflow.strategies.parm.measured_choice import Calibration
from moeflow.strategies.parm.ted_pipelined import AUTO_TED_CHUNKS, pipelined_name
from moeflow.topology import Topology

log = logging.getLogger("moeflow.parm")
_FITS: dict[int, ParmFits] = {}            # measured fits per topology (id), shared by layers


@dataclass(frozen=True)
class Prediction:
    schedule: str          # "s1", "s2", "ted" or the pipelined ted "ted-r<chunks>"
    t_d1: float            # seconds, Eq. 13 / line 4
    t_d2: float            # seconds, line 5
    t_ted: float | None = None     # seconds, the ted schedule (beyond the paper); or None
    # (chunks, seconds) of the pipelined ted per chunk count weighed (beyond the paper)
    t_ted_pipelined: tuple[tuple[int, float], ...] = ()


def _pick(t1: float, t2: float, t3: float | None,
          piped: tuple[tuple[int, float], ...] = ()) -> Prediction:
    """Lines 6-9, with the ted schedule and the pipelined ted as further branches where they
    are weighed: the least prediction, the earlier candidate on a tie (S1 before S2, as line
    6's ``<=``; a further candidate only where strictly faster)."""
    cands = [("s1", t1), ("s2", t2)]
    if t3 is not None:
        cands.append(("ted", t3))
    cands += [(pipelined_name(r), t) for r, t in piped]
    best = min(cands, key=lambda c: c[1])[0]
    return Prediction(best, t1, t2, t3, tuple(piped))


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


def ted_pipelined_time(fits: ParmFits, tokens: int, M: int, k: int, f: float, n_esp: int,
                       n_mp: int, n_ep: int, chunks: int) -> float | None:
    """The pipelined ted in ``chunks`` chunks (:mod:`.ted_pipelined`, beyond the Parm paper),
    or None when the fits lack a term: per chunk of ``z / r`` rows, the EP group carries
    ``t_ep = 2 (alpha_ep + beta_ep z / r)`` (out and back) and the ESP group ``t_esp =
    alpha_ag_esp + beta_ag_esp N_ESP z / r + alpha_rs_esp + beta_rs_esp N_ESP z / r``; they
    overlap chunk by chunk, so ``t = t_ep + t_esp + (r - 1) max(t_ep, t_esp) + alpha_ag +
    beta_ag N_MP z``: the fill (the first chunk's EP-AlltoAll and the last one's ESP
    collectives and EP-AlltoAll back run alone), ``r - 1`` overlapped steps bounded by the
    slower group, and the MP-AllGather after. ``r = 1`` is :func:`ted_time`. The experts'
    computation is in neither (as in Eq. 13 / 14), so the gain of hiding it is not predicted."""
    z = k * f * tokens * M / n_mp
    zc = z / chunks
    terms = {"ep": (fits.a2a_ep, zc, 2, n_ep), "esp_ag": (fits.ag_esp, n_esp * zc, 1, n_esp),
             "esp_rs": (fits.rs_esp, n_esp * zc, 1, n_esp), "mp": (fits.ag_mp, n_mp * z, 1, n_mp)}
    t = {}
    for name, (ab, elements, times, group) in terms.items():
        if group == 1:
            t[name] = 0.0
            continue
        if ab is None:
            return None
        t[name] = times * (ab.alpha + ab.beta * elements)
    ep, esp = t["ep"], t["esp_ag"] + t["esp_rs"]
    return ep + esp + (chunks - 1) * max(ep, esp) + t["mp"]


def algorithm1(fits: ParmFits, tokens: int, E: int, M: int, k: int, f: float, n_esp: int,
               n_mp: int, n_ep: int | None = None, ted_chunks: tuple[int, ...] = (),
               trimmed: frozenset[str] = frozenset(), f_kept: float | None = None
               ) -> Prediction:
    """Algorithm 1 for ``tokens = B L`` on one rank; with ``n_ep`` (the EP group's size) the
    ted schedule is weighed too where the fits have its terms, and the pipelined ted at each of
    ``ted_chunks`` (beyond the paper). ``trimmed``: the candidates whose plans send only the
    kept rows (``"s1"``, ``"ted"``: the pipelined ted with it), whose terms take ``f_kept``
    (kept rows / ``k B L``) for ``f`` (beyond the paper, module docstring)."""
    def factor(candidate: str) -> float:
        return f if f_kept is None or candidate not in trimmed else f_kept

    x = tokens * M                                               # line 1
    y1, y2 = (E * (k * factor(s) * tokens / E) * M * n_esp       # lines 2-3 (S1, S2)
              for s in ("s1", "s2"))
    a, ag, o = fits.a2a, fits.ag_mp, fits.overlap
    t_d1 = 2 * (a.alpha + a.beta * y1 / n_mp) + ag.alpha + ag.beta * x   # line 4 (Eq. 13)
    t_d2 = a.alpha + a.beta * y2 / n_mp + o.alpha + o.beta * y2         # line 5
    ft = factor("ted")
    t_ted = None if n_ep is None else ted_time(fits, tokens, M, k, ft, n_esp, n_mp, n_ep)
    piped = () if t_ted is None else tuple(
        (r, ted_pipelined_time(fits, tokens, M, k, ft, n_esp, n_mp, n_ep, r))
        for r in ted_chunks)
    return _pick(t_d1, t_d2, t_ted, piped)                              # lines 6-9


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
        self._trimmed: frozenset[str] = frozenset()  # set per call: candidates that trim
        self.kept: float | None = None               # the last trimmed call's kept fraction
        # measured confirmation (MoEConfig.parm_auto_measure, .measured_choice; beyond the
        # paper): the candidate being timed (returned by choose on every rank while set), the
        # confirming call's measurements, its wall time (seconds) and the candidates the
        # budget left unmeasured; choice: the schedule the last call ran
        self.forced: str | None = None
        self.calibration: Calibration | None = None
        self.confirm_s: float | None = None
        self.confirm_cut: list[str] = []
        self.choice: str | None = None

    def measure_pending(self, cfg: MoEConfig) -> bool:
        """Whether the measured confirmation is still to run (once per layer)."""
        return cfg.parm_auto_measure and self.calibration is None and self.forced is None

    @property
    def measured(self) -> dict[str, float]:
        """Each confirmed candidate's measured step (ms: median forward + backward of the
        layer, slowest rank); empty before the confirmation or without it."""
        if self.calibration is None:
            return {}
        return {c: 1e3 * t for c, t in self.calibration.measured_s.items()}

    def note_kept(self, rows: int, choices: int) -> None:
        """A trimmed call's kept rows out of its ``choices = k B L`` routing choices (this
        rank's): the next calls' ``f'`` (module docstring; beyond the paper)."""
        if choices > 0:
            self.kept = rows / choices

    def choose(self, cfg: MoEConfig, tokens: int, top_k: int, factor: float | None,
               device: torch.device | str = "cpu", trimmed: frozenset[str] = frozenset()
               ) -> str:
        """The call's schedule; ``trimmed``: the candidates whose plan would send only the
        kept rows in this call (the same on every rank: the config and the device type)."""
        if self.forced is not None:     # the confirmation: the same candidate on every rank
            return self.forced
        f, M = 1.0 if factor is None else float(factor), comm_width(cfg)
        self._trimmed = trimmed if factor is not None else frozenset()
        if self.fits is None:
            key = id(self.topo)
            if key not in _FITS:                # collective: every rank measures the same sizes
                most = host_all_reduce([float(tokens)], "max", self.topo.world_group)[0]
                sizes = elements_around(int(most), M, top_k, f, self.topo.esp_size,
                                        self.topo.mp_size)
                _FITS[key] = measure_parm_fits(self.topo, elements=sizes, width=M,
                                               device=device)
            self.fits = _FITS[key]
        # the ted schedule is weighed where it can run (no codecs; checks.check_ted), and so
        # is the pipelined ted at AUTO_TED_CHUNKS, with auto's own chunks: where the layer's
        # exchange is unchunked (pipeline_degree 1), so S1 / S2 run as Algorithm 1 models them
        self._n_ep = (self.topo.ep_size if cfg.codec == "none" and cfg.pipeline_degree == 1
                      else None)
        if cfg.equal_rank_tokens:      # trimmed: agreed with the kept rows known then
            key = (tokens, top_k, f, self._trimmed)
            pred = self._known.get(key)
            if pred is None:
                pred = self._known[key] = self._agree_once(cfg, tokens, top_k, f, M)
        else:
            mine = self._predict(cfg, tokens, top_k, f, M)
            sums = host_all_reduce(_terms(mine), "sum", self.topo.world_group)
            pred = _from_terms([t / self.topo.world_size for t in sums])    # the ranks' mean
        choice = pred.schedule if self.calibration is None else self.calibration.choose(pred)
        if (self.last is None or pred.schedule != self.last.schedule
                or choice != self.choice):
            piped = ", ".join(f"{pipelined_name(r)} {t:.3g} s" for r, t in pred.t_ted_pipelined)
            log.info("Parm Algorithm 1: %s (predicted t_D1 %.3g s, t_D2 %.3g s, ted %s, "
                     "pipelined ted %s)%s", pred.schedule, pred.t_d1, pred.t_d2,
                     "-" if pred.t_ted is None else f"{pred.t_ted:.3g} s", piped or "-",
                     "" if self.calibration is None else f"; measured choice: {choice}")
        self.last, self.choice = pred, choice
        return choice

    def _agree_once(self, cfg: MoEConfig, tokens: int, top_k: int, f: float,
                    M: int) -> Prediction:
        """``equal_rank_tokens``: the first call of a key. One all-reduce (max) of the
        predictions and of ``tokens`` and ``-tokens`` (their max and min): the promise holds
        iff they agree, and every rank then computed the same prediction from the same fits
        (taking the max keeps the choice the same on every rank even if given fits differ)."""
        mine = self._predict(cfg, tokens, top_k, f, M)
        *terms, most, neg_least = host_all_reduce(
            _terms(mine) + [float(tokens), -float(tokens)], "max", self.topo.world_group)
        if most != -neg_least:
            raise ConfigError(
                "MoEConfig.equal_rank_tokens=True is invalid: the ranks called the layer with "
                f"different token counts (from {int(-neg_least)} to {int(most)}), so Parm's "
                "Algorithm 1 cannot skip the all-reduce of its predictions; set "
                "equal_rank_tokens=False, or give every rank batches of the same shape")
        return _from_terms(terms)

    def _predict(self, cfg: MoEConfig, tokens: int, top_k: int, f: float,
                 M: int) -> Prediction:
        """This rank's prediction (before the ranks agree)."""
        f_kept = None
        if self._trimmed:             # before any trimmed call: balanced routing's kept rows
            f_kept = min(f, 1.0) if self.kept is None else min(f, self.kept)
        return algorithm1(self.fits, tokens, cfg.num_experts, M, top_k, f, self.topo.esp_size,
                          self.topo.mp_size, self._n_ep,
                          AUTO_TED_CHUNKS if self._n_ep is not None else (),
                          self._trimmed, f_kept)


def _terms(p: Prediction) -> list[float]:
    """A prediction as a fixed-length list for the ranks' all-reduce (the same length on every
    rank): t_D1, t_D2, then the ted schedule's and the pipelined ted's at each of
    ``AUTO_TED_CHUNKS``, -1 where not weighed (times are >= 0)."""
    piped = dict(p.t_ted_pipelined)
    return ([p.t_d1, p.t_d2, -1.0 if p.t_ted is None else p.t_ted]
            + [piped.get(r, -1.0) for r in AUTO_TED_CHUNKS])


def _from_terms(t: list[float]) -> Prediction:
    """:func:`_terms` back (after the all-reduce), the choice made again (lines 6-9)."""
    piped = tuple((r, v) for r, v in zip(AUTO_TED_CHUNKS, t[3:]) if v >= 0)
    return _pick(t[0], t[1], None if t[2] < 0 else t[2], piped)
