"""``moeflow bench parm``: Parm's schedules side by side (a scaled-down Table III / IV grid).

For every layout (N_MP, N_EP, N_ESP) that fits the world (N_MP, N_ESP in {1, 2} inside a node;
or the ``layouts`` given, e.g. N_MP = 4 across two nodes, each row recording which groups
cross the nodes, :func:`crossing`) and every MoE case (tokens per rank
``B L``, width ``M`` with ``H = 2 M``, capacity factor ``f``), one MoE layer per variant --
``baseline`` (DeepSpeed-MoE's order, Fig. 3a), ``s1``, ``s2`` (SAA), ``s2-aas``, ``ted``
(DeepSpeed-TED's order with the node-once exchange, beyond the paper), ``ted-r4`` (the same in
4 pipelined chunks, beyond the paper) and ``auto`` (Algorithm 1, with ``ted`` and the pipelined
``ted`` at 2 and 4 chunks as further candidates; the row's ``auto_choice``) -- runs forward +
backward round-robin on the same input (an MP group's ranks hold the same tokens), after
warm-up; each repetition's time is the slowest rank's; medians are reported. Per layout,
the alpha-beta fits of AG_MP, A2A_EP&ESP and SAA are measured on the running cluster first
(:func:`moeflow.strategies.parm.fits.measure_parm_fits`), twice: at the default 16 Ki-256 Ki
elements and at sizes spanning the messages this grid sends on the layout
(:func:`benchmarks.parm.parm_collectives.grid_elements`); the auto layers take the set
``fit_sizes`` names, and both sets' Algorithm 1 predictions (communication only, Eq. 13 and
line 5) are recorded next to the measured step times. With ``collectives`` every forward
collective of every schedule is also timed alone next to its prediction
(:mod:`benchmarks.parm.parm_collectives`). The summary gives the speedups over the baseline per
(N_MP, N_ESP) (Table IV), how often S1 / S2 beat the baseline (Eq. 6, 10), how often
Algorithm 1 picked the faster of S1 and S2 where they differ by more than 10 % (per fit set,
split by N_MP, and with ``collectives`` also against the measured comm chains), and SAA vs AAS.
"""

from __future__ import annotations

import statistics

import numpy as np


from benchmarks.parm.parm_collectives import (
    ab_json, format_case, grid_elements, measure_baseline_fits, messages, time_case)
from moeflow.bench.schedule_bench import time_variants
from moeflow.cases.parm_grid import case_config, case_input, case_routing
from moeflow.devices import resolve_device
from moeflow.dispatch.capacity import capacity
from moeflow.dispatch.plan import padding_trimmed
from moeflow.strategies.parm.algorithm1 import algorithm1, use_fits
from moeflow.strategies.parm.baseline_mp import drops_mp_duplicates
from moeflow.strategies.parm.fits import DEFAULT_ELEMENTS, measure_parm_fits
from moeflow.strategies.parm.padding import TRIMMING_SCHEDULES
from moeflow.strategies.parm.ted_pipelined import (AUTO_TED_CHUNKS, pipelined_chunks,
                                                   pipelined_name)
from moeflow.topology import Topology

#: the pipelined ted (beyond the paper, docs/parm.md): its 4 chunks, chunk c+1's EP-AlltoAll under
#: chunk c's ESP collectives and experts (one of the chunk counts auto weighs)
PIPELINED = pipelined_name(4)
PIPELINED_CONFIG = dict(parallel_schedule="ted", pipeline_degree=4, schedule="pipelined")
VARIANTS = [("baseline", dict(parallel_schedule="baseline")),
            ("s1", dict(parallel_schedule="s1")),
            ("s2", dict(parallel_schedule="s2")),
            ("s2-aas", dict(parallel_schedule="s2", parm_saa=False)),
            ("ted", dict(parallel_schedule="ted")),
            (PIPELINED, PIPELINED_CONFIG),
            ("auto", dict(parallel_schedule="auto"))]


def layouts(world: int, local: int) -> list[tuple[int, int, int]]:
    """(N_MP, N_EP, N_ESP) with N_MP, N_ESP in {1, 2} and MP or ESP > 1, ESP in a node."""
    out = []
    for mp in (1, 2):
        for esp in (1, 2):
            if (mp, esp) == (1, 1) or local % esp or local % mp:
                continue
            out.append((mp, world // esp // mp, esp))
    return out


PLACEMENTS = {"esp-in-node": True, "ep-in-node": False}


def parse_layout(text: str) -> tuple[int, int, int, bool]:
    """``MPxEPxESP[:esp-in-node|:ep-in-node]`` -> (N_MP, N_EP, N_ESP, esp_in_node), for layouts
    the default grid leaves out (N_MP or N_ESP = 4, groups spanning nodes: Section IV-A's
    cases 2 and 3). Raises ValueError naming the text and the form."""
    body, _, place = text.partition(":")
    parts = body.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts) \
            or (place and place not in PLACEMENTS):
        raise ValueError(f"layout {text!r}: expected MPxEPxESP with positive sizes and an "
                         f"optional :{' or :'.join(PLACEMENTS)}, e.g. 4x2x1 or 1x2x4:ep-in-node")
    mp, ep, esp = (int(p) for p in parts)
    return mp, ep, esp, PLACEMENTS[place or "esp-in-node"]


def crossing(topo: Topology) -> dict[str, bool]:
    """Which of this rank's Parm groups span more than one node (their traffic crosses the
    inter-node link; a group inside a node never sees the link's bandwidth): ``mp``, ``ep``,
    ``esp`` and ``ep_esp``, and what that means per schedule: the baseline moves the MoE
    traffic on EP and ESP (Eq. 1; with MP and whole experts also MP, 0.8.1's gather_tokens),
    S1 / S2 on EP&ESP and MP (Eq. 11 / 14)."""
    import torch.distributed as dist

    def spans(group) -> bool:
        if group is None:
            return False
        return len({r // topo.local_size for r in dist.get_process_group_ranks(group)}) > 1

    out = {name: spans(getattr(topo, f"{name}_group"))
           for name in ("mp", "ep", "esp", "ep_esp")}
    out["baseline"] = out["ep"] or out["esp"] or (drops_mp_duplicates(topo) and out["mp"])
    out["s1_s2"] = out["ep_esp"] or out["mp"]
    return out


def bench_worker(opts: dict) -> dict:
    world_topo = Topology.from_env()
    device = resolve_device(opts.get("device", "cpu"))
    rows, fits_out = [], {}
    M, k = opts["d_model"], opts["top_k"]
    grid_layouts = opts.get("layouts") or [
        (*lay, True) for lay in layouts(world_topo.world_size, world_topo.local_size)]
    for mp, ep, esp, in_node in grid_layouts:
        topo = Topology.from_env(ep_size=ep, mp_size=mp, esp_size=esp, esp_in_node=in_node)
        spans = crossing(topo)
        E = ep * opts["experts_per_ep"]
        # Algorithm 1's fits twice: at the default 16 Ki-256 Ki elements, and at sizes spanning
        # the messages this grid sends on this layout (no extrapolation); the auto layers take
        # the set --fit-sizes names, and both sets' choices are recorded
        grid = grid_elements(topo, opts["tokens"], M, E, k, opts["capacity_factors"])
        fit_sets = {"default": measure_parm_fits(topo, device=device),
                    "grid": measure_parm_fits(topo, elements=grid, width=M, device=device)}
        use_fits(topo, fit_sets[opts.get("fit_sizes", "grid")])
        key = f"{mp},{ep},{esp}" + ("" if in_node else ":ep-in-node")
        fits_out[key] = {"grid_elements": grid,
                                        **{lab: f.to_json() for lab, f in fit_sets.items()}}
        coll_fits = {}
        if opts.get("collectives"):
            for lab, sizes, width in (("default", DEFAULT_ELEMENTS, 64), ("grid", grid, M)):
                bf = measure_baseline_fits(topo, sizes, width=width, device=device)
                pf = fit_sets[lab]
                coll_fits[lab] = {"ag_mp": pf.ag_mp, "a2a": pf.a2a, "overlap": pf.overlap,
                                  **{n: v for n, v in bf.items() if n != "points"}}
                fits_out[key][lab]["baseline"] = {
                    **{n: ab_json(v) for n, v in bf.items() if n != "points"},
                    "points": bf["points"]}
        for tokens in opts["tokens"]:
            for f in opts["capacity_factors"]:
                base = case_config(M, E, k, f, opts.get("capacity_padding"))
                x = case_input(tokens, M, topo.rank // mp).to(device)
                got = time_variants(base, list(VARIANTS), topo, x, opts["warmup"], opts["reps"])
                # the auto layer's own candidates (AutoSchedule: ted and the pipelined ted at
                # AUTO_TED_CHUNKS) from the fits it was given, on the same token count on every
                # rank: the schedule it ran; where the layers trim, the trimming candidates'
                # terms with the ranks' mean kept fraction (beyond the paper)
                trimmed = (frozenset(TRIMMING_SCHEDULES)
                           if padding_trimmed(base.capacity_padding, x.device) else frozenset())
                f_kept = (kept_fraction(tokens, M, E, k, f, topo.world_size, mp)
                          if trimmed else None)
                preds = {lab: algorithm1(fs, tokens, E, M, k, f, esp, mp, ep, AUTO_TED_CHUNKS,
                                         trimmed, f_kept)
                         for lab, fs in fit_sets.items()}
                pred = preds[opts.get("fit_sizes", "grid")]
                row = {"n_mp": mp, "n_ep": ep, "n_esp": esp, "esp_in_node": in_node,
                       "crosses_nodes": spans, "tokens_per_rank": tokens,
                       "d_model": M, "d_expert": 2 * M, "num_experts": E, "top_k": k,
                       "capacity_factor": f, "capacity_padding": base.capacity_padding,
                       "kept_fraction": f_kept,
                       "trimmed": {r["variant"]: r["trimmed"] for r in got if "trimmed" in r},
                       "step_ms": {r["variant"]: r["step_ms"] for r in got},
                       "samples_ms": {r["variant"]: r["samples_ms"] for r in got},
                       "auto_choice": pred.schedule,
                       "predicted_comm_ms": predicted_ms(pred),
                       **auto_record(got),
                       "algorithm1": {lab: {"choice": p.schedule, "t_d1_ms": 1e3 * p.t_d1,
                                            "t_d2_ms": 1e3 * p.t_d2,
                                            "t_ted_ms": None if p.t_ted is None
                                            else 1e3 * p.t_ted,
                                            "t_ted_pipelined_ms": {
                                                pipelined_name(r): 1e3 * t
                                                for r, t in p.t_ted_pipelined}}
                                      for lab, p in preds.items()}}
                if opts.get("collectives"):
                    msgs = messages(topo, tokens, M, E, k, f)
                    row["collectives"] = time_case(topo, msgs, coll_fits, M, device,
                                                   opts["warmup"], opts["reps"])
                rows.append(row)
    return {"topology": repr(world_topo), "fit_sizes": opts.get("fit_sizes", "grid"),
            "capacity_padding": rows[0]["capacity_padding"] if rows else None,
            "fits": fits_out, "rows": rows, "summary": summarize(rows)}


AUTO_RECORD = ("auto_algorithm1", "auto_confirmed", "auto_measured_ms", "auto_confirm_s",
               "auto_confirm_cut")


def auto_record(got: list[dict]) -> dict:
    """The auto layer's own record (its strategy's ``choice_record``, through
    ``time_variants``): Algorithm 1's choice in the layer, the schedule it ran after the
    measured confirmation (``MoEConfig.parm_auto_measure``), the confirmation's median step
    per candidate (ms), its wall time (s, the fits included where the layer measured them)
    and the candidates the budget left unmeasured; empty where the layout runs no paused-MP
    schedule."""
    rec = next((r for r in got if r["variant"] == "auto"), {})
    return {k: rec[k] for k in AUTO_RECORD if k in rec}


def kept_fraction(tokens: int, M: int, E: int, k: int, f: float, world: int, mp: int
                  ) -> float:
    """The kept rows of the case's trimmed plans over its ``k B L`` choices, the mean over the
    ranks (each gating its MP group's whole batch, as the baseline and ted do): the ``f'`` an
    auto layer's Algorithm 1 weighs after its first trimmed call (:mod:`moeflow.strategies.
    parm.algorithm1`; S1 gates ``B L / N_MP`` tokens per rank, close to it)."""
    cap = capacity(tokens, k, E, f)
    kept = [np.minimum(np.bincount(ids.reshape(-1).numpy(), minlength=E), cap).sum()
            for ids in case_routing(tokens, M, E, k, f, world, mp)]
    return float(np.mean(kept)) / (k * tokens)


def trimmed_variants(res: dict) -> list[str]:
    """The variants whose plans sent only the kept rows in any row of a result (``trimmed``,
    recorded since ``--capacity-padding``; none in older results, which ran Parm padded)."""
    return sorted({v for r in res["rows"] for v, t in r.get("trimmed", {}).items() if t})


def predicted_ms(pred) -> dict:
    """Algorithm 1's predicted communication per candidate, ms (None: not weighed)."""
    return {"s1": 1e3 * pred.t_d1, "s2": 1e3 * pred.t_d2,
            "ted": None if pred.t_ted is None else 1e3 * pred.t_ted,
            **{pipelined_name(r): 1e3 * t for r, t in pred.t_ted_pipelined}}


def summarize(rows: list[dict]) -> dict:
    """Table IV analog, the share of cases S1 / S2 beat the baseline, Algorithm 1's accuracy."""
    table: dict[str, dict] = {}
    beat = {"s1": 0, "s2": 0, "any": 0}
    decided = correct = 0
    ted = {"beats_baseline": 0, "decided": 0, "picked_fastest": 0}   # rows with a ted column
    saa_vs_aas = []
    for r in rows:
        t = r["step_ms"]
        key = f"N_MP={r['n_mp']},N_ESP={r['n_esp']}"
        sp = table.setdefault(key, {"s1": [], "s2": [], "auto": []})
        for v in ("s1", "s2", "auto"):
            sp[v].append(t["baseline"] / t[v])
        beat["s1"] += t["s1"] < t["baseline"]
        beat["s2"] += t["s2"] < t["baseline"]
        beat["any"] += min(t["s1"], t["s2"]) < t["baseline"]
        saa_vs_aas.append(t["s2-aas"] / t["s2"])
        if abs(t["s1"] - t["s2"]) > 0.1 * min(t["s1"], t["s2"]):
            decided += 1
            correct += r["auto_choice"] == ("s1" if t["s1"] < t["s2"] else "s2")
        if "ted" in t:                  # Algorithm 1 with the ted schedule (beyond the paper)
            sp.setdefault("ted", []).append(t["baseline"] / t["ted"])
            ted["beats_baseline"] += t["ted"] < t["baseline"]
            # the candidates with a column (the pipelined ted's: newer results); a choice
            # without a column (another chunk count) cannot be scored
            cands = [v for v in t if v in ("s1", "s2", "ted") or pipelined_chunks(v)]
            first, second = sorted(cands, key=t.get)[:2]
            if t[second] > 1.1 * t[first] and r["auto_choice"] in cands:
                ted["decided"] += 1
                ted["picked_fastest"] += r["auto_choice"] == first
    n = len(rows)
    return {"algorithm1_accuracy": accuracy(rows),
            "mean_speedup_over_baseline": {k: {v: statistics.mean(s) for v, s in d.items()}
                                           for k, d in table.items()},
            "cases": n, "s1_beats_baseline": beat["s1"], "s2_beats_baseline": beat["s2"],
            "s1_or_s2_beats_baseline": beat["any"],
            "algorithm1_cases_differing_by_10pct": decided,
            "algorithm1_picked_faster": correct,
            "ted_beats_baseline": ted["beats_baseline"],
            "algorithm1_three_way_cases_differing_by_10pct": ted["decided"],
            "algorithm1_three_way_picked_fastest": ted["picked_fastest"],
            "saa_speedup_over_aas_mean": statistics.mean(saa_vs_aas) if saa_vs_aas else None}


def accuracy(rows: list[dict]) -> dict:
    """Per fit set (rows' ``algorithm1``), [picked the faster, cases where S1 and S2 differ by
    more than 10 %], over all rows and split by N_MP, against the measured step times and
    (keys ``comm_chain:<fit set>``, rows with ``collectives``) against the measured forward
    communication chains of S1 and S2 alone: at N_MP = 1 S1 and S2 are the same
    schedule by Eq. 11 / 14 (no MP-Split, no MP-AllGather), so a measured difference there is
    the implementation's, not the schedule's, and Algorithm 1's prediction is a near tie."""
    out: dict[str, dict[str, list[int]]] = {}
    for r in rows:
        part = "n_mp=1" if r["n_mp"] == 1 else "n_mp>1"
        # against the step times; with --collectives also against the measured forward
        # communication chains alone (what Algorithm 1 models: Eq. 13 and line 5)
        against = [("", r["step_ms"]["s1"], r["step_ms"]["s2"])]
        c = r.get("collectives", {})
        if "s1" in c and "s2" in c:
            against.append(("comm_chain:", c["s1"]["chain_ms"], c["s2"]["chain_ms"]))
        for prefix, t1, t2 in against:
            if abs(t1 - t2) <= 0.1 * min(t1, t2):
                continue
            faster = "s1" if t1 < t2 else "s2"
            for lab, p in r.get("algorithm1", {}).items():
                d = out.setdefault(prefix + lab,
                                   {"all": [0, 0], "n_mp=1": [0, 0], "n_mp>1": [0, 0]})
                for key in ("all", part):
                    d[key][0] += p["choice"] == faster
                    d[key][1] += 1
    return out


def format_result(res: dict) -> str:
    trimmed = trimmed_variants(res)
    lines = [res["topology"] + "  capacity_padding="     # results from before it: Parm padded
             + res.get("capacity_padding", "- (Parm padded)")
             + (f"  trimmed: {','.join(trimmed)}" if trimmed else ""),
             f"{'MP,EP,ESP':>9} {'BL':>5} {'f':>4} " + " ".join(f"{v:>9}" for v, _ in VARIANTS)
             + f" {'alg1':>6} {'ran':>6} {'pred s1':>8} {'pred s2':>8}", "-" * 107]
    for r in res["rows"]:
        t = r["step_ms"]
        lay = f"{r['n_mp']},{r['n_ep']},{r['n_esp']}" + ("" if r.get("esp_in_node", True) else "e")
        lines.append(f"{lay:<9} {r['tokens_per_rank']:>5} "
                     f"{r['capacity_factor']:>4} "       # results from before ted: "-"
                     + " ".join(f"{t[v]:>9.1f}" if v in t else f"{'-':>9}" for v, _ in VARIANTS)
                     + f" {r['auto_choice']:>6} {r.get('auto_confirmed') or '-':>6} "
                     f"{r['predicted_comm_ms']['s1']:>8.2f} "
                     f"{r['predicted_comm_ms']['s2']:>8.2f}")
    s = res["summary"]
    lines.append("step ms (median); alg1 = Algorithm 1's choice, ran = the auto layer's after "
                 "its measured confirmation; pred = Algorithm 1's communication time, ms; "
                 "e: EP groups in a node (Section IV-A case 3)")
    for k, d in s["mean_speedup_over_baseline"].items():
        lines.append(f"{k}: mean speedup over baseline  S1 {d['s1']:.2f}x  S2 {d['s2']:.2f}x  "
                     f"Parm(auto) {d['auto']:.2f}x")
    lines.append(f"S1 beats baseline in {s['s1_beats_baseline']}/{s['cases']}, S2 in "
                 f"{s['s2_beats_baseline']}/{s['cases']}, S1 or S2 in "
                 f"{s['s1_or_s2_beats_baseline']}/{s['cases']}")
    lines.append(f"Algorithm 1 picked the faster in {s['algorithm1_picked_faster']}/"
                 f"{s['algorithm1_cases_differing_by_10pct']} cases where S1 and S2 differ "
                 f"by > 10%; SAA vs AAS: mean AAS/SAA time {s['saa_speedup_over_aas_mean']:.3f}")
    for lab, d in s.get("algorithm1_accuracy", {}).items():
        what = (f"the {lab.split(':')[1]} fits vs the comm chains alone" if ":" in lab
                else f"the {lab} fits")
        lines.append(f"Algorithm 1 with {what}: picked the faster in "
                     + ", ".join(f"{d[key][0]}/{d[key][1]} ({key.replace('n_mp', 'N_MP')})"
                                 if key != "all" else f"{d[key][0]}/{d[key][1]}"
                                 for key in ("all", "n_mp>1", "n_mp=1")))
    for r in res["rows"]:
        if "collectives" in r:
            lines.extend(format_case(r))
    return "\n".join(lines)
