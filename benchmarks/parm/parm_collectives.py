"""Each Parm collective timed alone next to its alpha-beta prediction (Eq. 1, 11, 14).

For one layout and one MoE case of ``moeflow bench parm`` (tokens per rank ``B L``, width
``M``, ``E`` experts, top-``k``, capacity factor ``f``), :func:`messages` lists the forward
collectives each schedule runs, with the sizes this code actually moves (capacity
``C = ceil(k f n / E)`` of the batch the rank gates, :func:`moeflow.dispatch.capacity.capacity`):

* baseline (Fig. 3a, Eq. 1, ``baseline.py``): where the ESP peers hold different tokens, the
  ESP-AllGather of the input (``B L M N_ESP`` gathered, ``AG_ESP(BLM N_ESP)``; the peers' int64
  row maps gathered beside it are not timed), EP-AlltoAll x 2 (``E T M N_ESP`` sent) and
  ESP-AllReduce (``E T M N_ESP``); where the ESP group lies inside the MP group (DeepSpeed-MoE
  0.8.1's layout), no gather and ``E T M`` in the EP-AlltoAlls and the ESP-AllReduce, as 0.8.1
  moves; ESP-Split is local in forward; with MP and whole experts (``N_ESP = 1``), 0.8.1's
  duplicate-token drop: ``E T M / N_MP`` in the EP-AlltoAlls and the MP-AllGather of the
  experts' outputs (``E T M`` gathered, ``baseline_mp.py``);
* S1 (Fig. 3b, Eq. 11): EP&ESP-AlltoAll x 2 over the block (``E T M N_ESP / N_MP``, ``T`` from
  the ``B L / N_MP`` tokens S1 gates), MP-AllGather of the outputs (``B L M``);
* S2 (Fig. 3c, Eq. 14): EP&ESP-AlltoAll (MP rank m's share of every expert's ``C`` rows), then
  SAA (the all-to-all back overlapped with the MP-AllGather of the received slices, the shards'
  partials: ``N_ESP E C M`` gathered, where Eq. 14 writes ``AG_MP(ETM)``); the AAS pieces (the
  all-to-all back, the MP-AllGather alone) too.

:func:`time_case` times every piece alone on the layout's own groups (warm-up, repetitions,
the slowest rank per repetition via :func:`moeflow.measure.timing.time_aligned`, median), and
each schedule's whole forward chain of collectives back to back as the schedule issues them
(no expert compute between them: "the schedule's communication"). Predictions: the piece's
alpha-beta fit (``fits``: ``ag_mp`` / ``a2a`` / ``overlap`` as Algorithm 1 uses them,
:mod:`moeflow.strategies.parm.fits`, plus the baseline's ``ag_esp`` / ``a2a_ep`` / ``ar_esp``
from :func:`measure_baseline_fits`), and per schedule the equation's total (the sum of the
predicted terms) beside the sum of the measured pieces and the measured chain.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from moeflow.measure.linkmodel import AlphaBeta, fit_alpha_beta
from moeflow.measure.timing import time_aligned
from moeflow.dispatch.capacity import capacity
from moeflow.strategies.parm.baseline import esp_peers_share_tokens
from moeflow.strategies.parm.baseline_mp import drops_mp_duplicates
from moeflow.strategies.parm.collectives import _all_gather
from moeflow.strategies.parm.s1 import token_rows
from moeflow.strategies.parm.saa import saa
from moeflow.schedule.chunks import chunk_counts
from moeflow.topology import Topology

# forward chains, in issue order (Fig. 3); "saa" is the all-to-all back with the AllGather
CHAINS = {"baseline": ["ag_esp", "a2a_ep", "ar_esp", "a2a_ep_back", "ag_mp"],
          "s1": ["a2a", "a2a_back", "ag_mp"],
          "s2": ["a2a", "saa"],
          "s2-aas": ["a2a", "a2a_back", "ag_mp"]}
# the equation each schedule's prediction comes from, and which pieces it sums
EQUATIONS = {"baseline": ("Eq. 1", ["ag_esp", "a2a_ep", "ar_esp", "a2a_ep_back", "ag_mp"]),
             "s1": ("Eq. 11 (line 4)", ["a2a", "a2a_back", "ag_mp"]),
             "s2": ("Alg. 1 line 5", ["a2a", "saa"]),
             "s2-aas": ("Eq. 7 bound", ["a2a", "a2a_back", "ag_mp"])}


@dataclass(frozen=True)
class Message:
    """One forward collective of one schedule, as this rank runs it."""

    key: str            # piece name in CHAINS
    name: str           # the paper's name
    fit: str            # which alpha-beta fit predicts it
    group: str          # "esp", "ep", "ep_esp", "mp", "ep_esp+mp"
    elements: int       # this rank's elements (a2a: sent; AllGather: gathered; AllReduce: buffer)
    fit_x: int          # the fit's variable (SAA: y = sent x N_MP, as Algorithm 1 line 5)
    paper: str          # the paper's term
    send: tuple = ()    # all-to-all: rows to each rank of the group
    recv: tuple = ()    # all-to-all: rows from each rank
    ag_rows: tuple = ()  # AllGather: rows from each rank (SAA: (mp, u) rows per MP rank, slot)


def _slot_rows(per_mp: list[int], topo: Topology) -> list[int]:
    """Rows per expert the rank at each slot of this EP&ESP block sends (its MP rank's)."""
    first = topo.rank - topo.expert_slot
    return [per_mp[(first + p) % topo.mp_size] for p in range(topo.expert_slots)]


def messages(topo: Topology, tokens: int, M: int, E: int, k: int, f: float) -> dict:
    """``{schedule: {piece: Message}}`` of the forward collectives (module docstring); groups of
    one rank (no communication) are left out."""
    mp, ep, esp, u = topo.mp_size, topo.ep_size, topo.esp_size, topo.expert_slots
    e_local = E // ep
    out: dict[str, dict[str, Message]] = {}
    # baseline: every rank gates its whole (MP-replicated) batch; the input is gathered over
    # ESP only where the peers hold different tokens (else each sends its own copy, as 0.8.1)
    cap = capacity(tokens, k, E, f)
    copies = 1 if esp_peers_share_tokens(topo) else esp
    rows = copies * E * cap                      # exchanged, reduced, and back
    term = "ETM N_ESP" if copies > 1 else "ETM"
    base: dict[str, Message] = {}
    if copies > 1:
        base["ag_esp"] = Message("ag_esp", "ESP-AllGather", "ag_esp", "esp",
                                 esp * tokens * M, esp * tokens * M, "AG_ESP(BLM N_ESP)",
                                 ag_rows=(tokens,) * esp)
    if esp > 1:
        base["ar_esp"] = Message("ar_esp", "ESP-AllReduce", "ar_esp", "esp", rows * M,
                                 rows * M, f"AR_ESP({term})")
    if ep > 1 and not drops_mp_duplicates(topo):
        split = (copies * e_local * cap,) * ep
        for key in ("a2a_ep", "a2a_ep_back"):
            base[key] = Message(key, "EP-AlltoAll", "a2a_ep", "ep", rows * M, rows * M,
                                f"A2A_EP({term})", split, split)
    if drops_mp_duplicates(topo):      # 0.8.1's drop_tokens / gather_tokens (baseline_mp.py)
        share = [int(s[0]) for s in chunk_counts(np.array([cap]), mp)]
        r = _slot_rows(share, topo)                  # rows per expert, per EP rank (N_ESP 1)
        send = (e_local * r[topo.expert_slot],) * ep
        recv = tuple(e_local * v for v in r)
        if ep > 1:
            base["a2a_ep"] = Message("a2a_ep", "EP-AlltoAll", "a2a_ep", "ep", sum(send) * M,
                                     sum(send) * M, "A2A_EP(ETM / N_MP)", send, recv)
            base["a2a_ep_back"] = Message("a2a_ep_back", "EP-AlltoAll", "a2a_ep", "ep",
                                          sum(recv) * M, sum(recv) * M, "A2A_EP(ETM / N_MP)",
                                          recv, send)
        gathered = E * sum(share) * M
        base["ag_mp"] = Message("ag_mp", "MP-AllGather (gather_tokens)", "ag_mp", "mp",
                                gathered, gathered, "AG_MP(ETM)",
                                ag_rows=tuple(E * v for v in share))
    out["baseline"] = base
    if mp == 1 and u == 1:
        return out
    # S1: MP rank m gates its tokens token_rows(n, mp)[m]
    n_m = [len(r) for r in token_rows(tokens, mp)]
    r = _slot_rows([capacity(n, k, E, f) for n in n_m], topo)
    out["s1"] = _s1_s2(topo, r, e_local, M, "E T M N_ESP / N_MP")
    if mp > 1:
        out["s1"]["ag_mp"] = Message("ag_mp", "MP-AllGather", "ag_mp", "mp", tokens * M,
                                     tokens * M, "AG_MP(BLM)", ag_rows=tuple(n_m))
    # S2: the whole batch gated on every MP rank, MP rank m keeps its share of each expert's C
    share = [int(s[0]) for s in chunk_counts(np.array([cap]), mp)]
    r = _slot_rows(share, topo)
    s2 = _s1_s2(topo, r, e_local, M, "E T M N_ESP / N_MP")
    ag = tuple(tuple(e_local * share[m] for _ in range(u)) for m in range(mp))
    send_back = tuple(e_local * v for v in r)            # slot p's rows go back to p
    recv_back = (e_local * r[topo.expert_slot],) * u
    back = sum(send_back) * M
    gathered = sum(map(sum, ag)) * M
    s2["saa"] = Message("saa", "SAA (A2A back || MP-AllGather)" if mp > 1 else
                        "SAA (phased A2A back)", "overlap", "ep_esp+mp" if mp > 1 else "ep_esp",
                        back, back * mp,
                        "Overlap(ETM N_ESP / N_MP) + AG_MP(ETM)" if mp > 1 else
                        "Overlap(ETM N_ESP) = A2A_EP&ESP(ETM N_ESP)", send_back, recv_back, ag)
    if mp > 1:
        s2["ag_mp"] = Message("ag_mp", "MP-AllGather", "ag_mp", "mp", gathered, gathered,
                              "AG_MP(ETM)", ag_rows=tuple(sum(a) for a in ag))
    out["s2"] = s2
    return out


def _s1_s2(topo: Topology, r: list[int], e_local: int, M: int, paper: str) -> dict:
    """The EP&ESP-AlltoAll and its way back: slot p sends ``e_local r[p]`` rows to each slot
    (a block of one rank: no communication, left out)."""
    me, u = topo.expert_slot, topo.expert_slots
    if u == 1:
        return {}
    send, recv = (e_local * r[me],) * u, tuple(e_local * r[p] for p in range(u))
    there = Message("a2a", "EP&ESP-AlltoAll", "a2a", "ep_esp", sum(send) * M, sum(send) * M,
                    f"A2A_EP&ESP({paper})", send, recv)
    back = Message("a2a_back", "EP&ESP-AlltoAll back", "a2a", "ep_esp", sum(recv) * M,
                   sum(recv) * M, f"A2A_EP&ESP({paper})", recv, send)
    return {"a2a": there, "a2a_back": back}


def _runner(msg: Message, topo: Topology, M: int, device: torch.device):
    """A zero-argument function that runs ``msg`` once on its group (buffers made here)."""
    def rows(n):
        return torch.randn(n, M, device=device)

    if msg.key in ("a2a_ep", "a2a_ep_back", "a2a", "a2a_back"):
        group = topo.ep_group if msg.group == "ep" else topo.ep_esp_group
        x, out = rows(sum(msg.send)), rows(sum(msg.recv))
        return lambda: dist.all_to_all_single(out, x, list(msg.recv), list(msg.send),
                                              group=group)
    if msg.key in ("ag_esp", "ag_mp"):
        group = topo.esp_group if msg.group == "esp" else topo.mp_group
        top = max(msg.ag_rows)      # padded to the largest block, as collectives._gather does
        x, out = rows(top), rows(top * len(msg.ag_rows))
        return lambda: _all_gather(out, x, group=group)
    if msg.key == "ar_esp":
        x = rows(msg.elements // M)
        return lambda: dist.all_reduce(x, group=topo.esp_group)
    if msg.key == "saa":
        first, mp_first = topo.rank - topo.expert_slot, topo.rank - topo.mp_rank
        u = topo.expert_slots
        slots = [(mp_first + m) % u for m in range(topo.mp_size)]
        y = rows(sum(msg.send))
        return lambda: saa(y, list(msg.send), list(msg.recv), np.asarray(msg.ag_rows),
                           topo.expert_slot, slots, topo.mp_rank,
                           [first + p for p in range(u)], topo.ep_esp_group, topo.mp_group)
    raise ValueError(f"no runner for piece {msg.key!r}")


def _median(fn, topo: Topology, device: torch.device, warmup: int, reps: int) -> float:
    times = [time_aligned(fn, topo, device) for _ in range(warmup + reps)]
    return statistics.median(times[warmup:])


def _predict(fits: dict[str, AlphaBeta], msg: Message) -> float | None:
    ab = fits.get(msg.fit)
    if ab is None or (ab.alpha == 0 and ab.beta == 0):
        return None
    return ab.predict(msg.fit_x)


def time_case(topo: Topology, msgs: dict, fit_sets: dict[str, dict[str, AlphaBeta]], M: int,
              device: torch.device, warmup: int, reps: int) -> dict:
    """Time every piece alone and every schedule's chain (collective: every rank calls it with
    the same case); return the per-schedule table, ms, with each fit set's predictions
    (``fit_sets``: label -> {fit name: AlphaBeta})."""
    out = {}
    for sched, chain in CHAINS.items():
        src = msgs.get("s2" if sched == "s2-aas" else sched)
        if src is None:
            continue
        pieces = [src[k] for k in chain if k in src]
        if not pieces:
            continue
        run = {p.key: _runner(p, topo, M, device) for p in pieces}
        measured = {p.key: _median(run[p.key], topo, device, warmup, reps) for p in pieces}

        def whole():
            for p in pieces:
                run[p.key]()

        chain_s = _median(whole, topo, device, warmup, reps)
        eq, terms = EQUATIONS[sched]
        rows, totals = [], {}
        for p in pieces:
            rows.append({"piece": p.key, "collective": p.name, "group": p.group,
                         "elements": p.elements, "fit_x": p.fit_x, "paper_term": p.paper,
                         "fit": p.fit, "measured_ms": 1e3 * measured[p.key],
                         "predicted_ms": {}})
        for label, fits in fit_sets.items():
            preds = []
            for p, row in zip(pieces, rows):
                v = _predict(fits, p)
                row["predicted_ms"][label] = None if v is None else 1e3 * v
                if p.key in terms:
                    preds.append(row["predicted_ms"][label])
            totals[label] = None if any(v is None for v in preds) else sum(preds)
        out[sched] = {"equation": eq, "pieces": rows, "equation_total_ms": totals,
                      "sum_of_pieces_ms": sum(r["measured_ms"] for r in rows),
                      "chain_ms": 1e3 * chain_s}
    return out


def measure_baseline_fits(topo: Topology, elements, width: int = 64, warmup: int = 1,
                          reps: int = 3, device: torch.device | str = "cpu") -> dict:
    """Alpha-beta fits of the baseline's ESP-AllGather (gathered elements), EP-AlltoAll (sent
    elements) and ESP-AllReduce (buffer elements) on ``topo``'s groups, over ``elements``
    (Eq. 12's form; collective). Groups of one rank get no fit (left out)."""
    device = torch.device(device)
    esp, ep = topo.esp_size, topo.ep_size
    pts: dict[str, list] = {"ag_esp": [], "a2a_ep": [], "ar_esp": []}
    for z in elements:
        if esp > 1:
            part = torch.randn(max(1, z // width // esp), width, device=device)
            gathered = part.new_empty((esp * part.shape[0], width))
            pts["ag_esp"].append([gathered.numel(), _median(
                lambda: _all_gather(gathered, part, group=topo.esp_group), topo, device,
                warmup, reps)])
            buf = torch.randn(max(1, z // width), width, device=device)
            pts["ar_esp"].append([buf.numel(), _median(
                lambda: dist.all_reduce(buf, group=topo.esp_group), topo, device, warmup,
                reps)])
        if ep > 1:
            per = max(1, z // width // ep)
            x = torch.randn(per * ep, width, device=device)
            out = torch.empty_like(x)
            pts["a2a_ep"].append([x.numel(), _median(
                lambda: dist.all_to_all_single(out, x, group=topo.ep_group), topo, device,
                warmup, reps)])
    return {k: fit_alpha_beta([p[0] for p in v], [p[1] for p in v])
            for k, v in pts.items() if len(v) >= 2} | {"points": pts}


def grid_elements(topo: Topology, tokens: list[int], M: int, E: int, k: int,
                  factors: list[float], points: int = 4) -> list[int]:
    """``points`` sizes, geometric from the smallest to the largest message the grid's
    schedules send on this layout (what the fits should span instead of extrapolating), on
    any rank: the fits are collective, so every rank must measure the same sizes, and a rank's
    messages depend on its MP rank and slot where the capacity does not split evenly over the
    MP group (e.g. N_MP = 4). Arithmetic only: each rank's view of the layout, no collective."""
    sizes = [m.elements for r in range(topo.world_size) for n in tokens for f in factors
             for sched in messages(replace(topo, rank=r), n, M, E, k, f).values()
             for m in sched.values()]
    lo, hi = min(sizes), max(sizes)
    if lo == hi:
        lo, hi = max(1, lo // 2), 2 * hi
    return sorted({int(round(lo * (hi / lo) ** (i / (points - 1)))) for i in range(points)})


def ab_json(ab: AlphaBeta) -> dict:
    def num(q: float) -> float | None:
        return None if math.isnan(q) else q
    return {"alpha_s": ab.alpha, "beta_s_per_element": ab.beta, "r2": num(ab.r2),
            "max_rel_err": num(ab.max_rel_err)}


def format_case(row: dict, labels: tuple[str, ...] = ("grid", "default")) -> list[str]:
    """A readable table of one case's pieces and totals (ms)."""
    head = " ".join(f"{'pred@' + lab:>13}" for lab in labels)
    lines = [f"-- N_MP={row['n_mp']} N_EP={row['n_ep']} N_ESP={row['n_esp']} "
             f"BL={row['tokens_per_rank']} f={row['capacity_factor']}: forward collectives "
             "alone, ms (pred@X: alpha-beta fit measured at the X sizes)",
             f"   {'schedule':<8} {'collective':<31} {'group':<9} {'elements':>9} "
             f"{'measured':>9} {head}  paper term"]
    for sched, d in row["collectives"].items():
        for p in d["pieces"]:
            preds = " ".join(f"{_ms(p['predicted_ms'].get(lab)):>13}" for lab in labels)
            lines.append(f"   {sched:<8} {p['collective']:<31} {p['group']:<9} "
                         f"{p['elements']:>9} {p['measured_ms']:>9.2f} {preds}"
                         f"  {p['paper_term']}")
        tot = " ".join(f"{_ms(d['equation_total_ms'].get(lab)):>13}" for lab in labels)
        lines.append(f"   {sched:<8} {'= ' + d['equation'] + ' total':<31} {'':<9} {'':>9} "
                     f"{'':>9} {tot}")
        lines.append(f"   {sched:<8} {'  sum of measured pieces':<31} {'':<9} {'':>9} "
                     f"{d['sum_of_pieces_ms']:>9.2f}")
        lines.append(f"   {sched:<8} {'  measured chain (all in order)':<31} {'':<9} {'':>9} "
                     f"{d['chain_ms']:>9.2f}")
    return lines


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"
