"""Alpha-beta fits of Parm's collectives on the running cluster (Section V-A, Eq. 12).

Algorithm 1 needs three models, each ``alpha + beta * elements`` fitted by least squares
(:func:`moeflow.measure.linkmodel.fit_alpha_beta`) to the median time of the collective over a
few sizes, measured on the layout's own process groups (so the emulated or real links, the
placement and the concurrent groups are those the layer will see):

* ``ag_mp``: MP-AllGather, ``x`` = elements of the gathered output (``B L M`` in S1);
* ``a2a``: EP&ESP-AlltoAll, ``z`` = elements of one rank's send buffer (``y / N_MP``);
* ``overlap``: SAA (the all-to-all with the MP-AllGather of its slices, :mod:`.saa`), fitted
  against ``y = z N_MP``, the variable of Algorithm 1 line 5 (``alpha_o + beta_o y``).

Beyond the Parm paper, for the ``ted`` schedule (:mod:`.ted`, DeepSpeed-TED's order) that
:mod:`.algorithm1` weighs beside S1 and S2 (None where the group has one rank):

* ``a2a_ep``: EP-AlltoAll over the EP group, elements of one rank's send buffer;
* ``ag_esp``: ESP-AllGather, elements of the gathered output;
* ``rs_esp``: ESP-ReduceScatter, elements of one rank's input (the whole gathered rows).

``beta`` is seconds per element of the measured dtype. Every rank measures together and gets
the same fits (each time is the slowest rank's).

Sizes: a line fitted over small messages and evaluated at messages 20x larger extrapolates
(on the emulated cluster a fit from 16Ki-256Ki elements missed messages of 1-5Mi elements,
docs/benchmarks/parm.md). :func:`elements_around` gives sizes that span the messages one call
of Algorithm 1 evaluates; ``parallel_schedule="auto"`` measures there, ``moeflow bench parm``
over the whole grid's messages.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.measure.linkmodel import AlphaBeta, fit_alpha_beta
from moeflow.measure.timing import time_aligned
from moeflow.strategies.parm.collectives import _all_gather, _reduce_scatter
from moeflow.strategies.parm.saa import saa
from moeflow.topology import Topology

DEFAULT_ELEMENTS = (1 << 14, 1 << 16, 1 << 18)
TED_FITS = ("a2a_ep", "ag_esp", "rs_esp")


@dataclass(frozen=True)
class ParmFits:
    ag_mp: AlphaBeta
    a2a: AlphaBeta
    overlap: AlphaBeta
    points: dict | None = None       # {"ag_mp": [[elements, seconds], ...], ...}
    a2a_ep: AlphaBeta | None = None  # the ted schedule's pieces (module docstring)
    ag_esp: AlphaBeta | None = None
    rs_esp: AlphaBeta | None = None

    def to_json(self) -> dict:
        def ab(v: AlphaBeta) -> dict:
            def num(q: float) -> float | None:        # no fit (N_MP = 1): None, not NaN
                return None if math.isnan(q) else q
            return {"alpha_s": v.alpha, "beta_s_per_element": v.beta, "r2": num(v.r2),
                    "max_rel_err": num(v.max_rel_err)}
        out = {"ag_mp": ab(self.ag_mp), "a2a": ab(self.a2a), "overlap": ab(self.overlap),
               "points": self.points}
        for name in TED_FITS:
            if getattr(self, name) is not None:
                out[name] = ab(getattr(self, name))
        return out

    @classmethod
    def from_json(cls, d: dict) -> "ParmFits":
        def ab(v):
            return AlphaBeta(v["alpha_s"], v["beta_s_per_element"], 0,
                             math.nan if v.get("r2") is None else v["r2"],
                             math.nan if v.get("max_rel_err") is None else v["max_rel_err"])
        return cls(ab(d["ag_mp"]), ab(d["a2a"]), ab(d["overlap"]), d.get("points"),
                   **{n: ab(d[n]) for n in TED_FITS if d.get(n) is not None})


def elements_around(tokens: int, M: int, k: int, f: float, n_esp: int, n_mp: int,
                    points: int = 3) -> tuple[int, ...]:
    """Fit sizes around the messages Algorithm 1 evaluates for ``tokens = B L`` (lines 1-3):
    ``x = B L M`` (AG_MP) and ``z = y / N_MP = k f B L M N_ESP / N_MP`` (the all-to-all's and
    SAA's send buffer): ``points`` sizes, geometric from a quarter of the smaller to the
    larger (at least 4 Ki elements)."""
    x = tokens * M
    z = k * f * tokens * M * n_esp / n_mp
    hi = max(4096.0, x, z)
    lo = max(1024.0, min(x, z) / 4)
    if points < 2:
        raise ValueError(f"elements_around points={points} is invalid: a line needs >= 2")
    return tuple(int(round(lo * (hi / lo) ** (i / (points - 1)))) for i in range(points))


def _median_time(run, topo: Topology, device: torch.device, warmup: int, reps: int) -> float:
    times = [time_aligned(run, topo, device) for _ in range(warmup + reps)]
    return statistics.median(times[warmup:])


def measure_parm_fits(topo: Topology, elements=DEFAULT_ELEMENTS, width: int = 64,
                      warmup: int = 1, reps: int = 3, dtype=torch.float32,
                      device: torch.device | str = "cpu") -> ParmFits:
    """Measure and fit AG_MP, A2A_EP&ESP and SAA on ``topo``'s groups (collective: every rank
    calls it with the same arguments)."""
    device = torch.device(device)
    u, mp = topo.expert_slots, topo.mp_size
    me, first = topo.expert_slot, topo.rank - topo.expert_slot
    mp_first = topo.rank - topo.mp_rank
    slots = [(mp_first + m) % u for m in range(mp)]
    pts: dict[str, list] = {"ag_mp": [], "a2a": [], "overlap": [], "a2a_ep": [],
                            "ag_esp": [], "rs_esp": []}
    for z in elements:
        per = max(1, z // width // u)                 # rows to each slot
        y = torch.randn(per * u, width, dtype=dtype, device=device)
        split = [per] * u
        out = torch.empty_like(y)

        def a2a():
            dist.all_to_all_single(out, y, split, split, group=topo.ep_esp_group)

        def both():
            saa(y, split, split, [[per] * u] * mp, me, slots, topo.mp_rank,
                [first + p for p in range(u)], topo.ep_esp_group, topo.mp_group)

        n = y.numel()
        pts["a2a"].append([n, _median_time(a2a, topo, device, warmup, reps)])
        pts["overlap"].append([n * mp, _median_time(both, topo, device, warmup, reps)])
        if mp > 1:
            part = y[:max(1, y.shape[0] // mp)]
            gathered = part.new_empty((mp * part.shape[0], width))

            def ag():
                _all_gather(gathered, part, group=topo.mp_group)

            pts["ag_mp"].append([gathered.numel(),
                                 _median_time(ag, topo, device, warmup, reps)])
        _measure_ted(pts, topo, z, width, dtype, device, warmup, reps)
    fit = {k: fit_alpha_beta([p[0] for p in v], [p[1] for p in v]) if len(v) >= 2
           else AlphaBeta(0.0, 0.0) for k, v in pts.items()}
    ted = {k: fit[k] for k in TED_FITS if pts[k]}
    return ParmFits(fit["ag_mp"], fit["a2a"], fit["overlap"], pts, **ted)


def _measure_ted(pts: dict, topo: Topology, z: int, width: int, dtype, device, warmup: int,
                 reps: int) -> None:
    """The ted schedule's EP-AlltoAll (``z`` elements sent) and ESP-AllGather /
    ReduceScatter (``z`` elements each rank contributes), where the group has > 1 rank."""
    ep, esp = topo.ep_size, topo.esp_size
    if ep > 1:
        per = max(1, z // width // ep)
        x = torch.randn(per * ep, width, dtype=dtype, device=device)
        out = torch.empty_like(x)

        def a2a():
            dist.all_to_all_single(out, x, [per] * ep, [per] * ep, group=topo.ep_group)

        pts["a2a_ep"].append([x.numel(), _median_time(a2a, topo, device, warmup, reps)])
    if esp > 1:
        part = torch.randn(max(1, z // width), width, dtype=dtype, device=device)
        whole = part.new_empty((esp * part.shape[0], width))

        def ag():
            _all_gather(whole, part, group=topo.esp_group)

        def rs():
            _reduce_scatter(part, whole, group=topo.esp_group)

        pts["ag_esp"].append([whole.numel(), _median_time(ag, topo, device, warmup, reps)])
        pts["rs_esp"].append([whole.numel(), _median_time(rs, topo, device, warmup, reps)])
