"""Paired (interleaved) ratios of `moeflow bench parm` result files, for docs/benchmarks/parm.md.

Both `bench parm` and `bench parm --compare deepspeed` time their variants round-robin: step i
of every variant ran in the same round, under the same load of the shared machine. This script
divides the comparator's step i by the variant's step i (a speedup > 1 means the variant is
faster) and prints, per row, the median of those per-round ratios and their min-max (the noise).

S1 vs S2 (Parm Section V-B, Algorithm 1): a case is *decided* when every round agrees on which
of S1 and S2 was faster (all per-round ratios s2/s1 on one side of 1); Algorithm 1's choice
(the `auto` layer's, `auto_choice`) is scored only on decided cases with N_MP > 1 (at N_MP = 1
S1 and S2 are the same schedule by Eq. 2), next to the line "always S1".

Every candidate Algorithm 1 weighs (S1, S2, ``ted``, the pipelined ``ted-r4``; whichever of
them the run timed): per row, the choice is *right* when it was faster than every other timed
candidate in every round, *wrong* when some other candidate was faster than it in every round,
and a *tie* otherwise (the rounds do not separate them); a choice the run did not time as a
column (``ted-r2``) is not scored. ``auto_choice`` is Algorithm 1's own choice (the prediction
alone); in runs since the measured confirmation (``MoEConfig.parm_auto_measure``) the row also
records the schedule the auto layer ran after timing the candidates (``auto_confirmed``), which
is printed and scored the same way beside it.

Rows of ``bench parm --layouts`` (N_MP or N_ESP = 4 on 2-rank nodes) also say which groups
cross the nodes, per schedule; where none of a schedule's does, its traffic stays inside a node
and the run's bandwidth label does not apply to it (marked "in node").

Usage: python docs/benchmarks/scripts/parm_paired.py FILE.json [FILE.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys


def paired(a: list[float], b: list[float]) -> list[float]:
    """Per-round ratios a_i / b_i (comparator over variant: > 1 = the variant is faster)."""
    return [x / y for x, y in zip(a, b)]


def cell(r: list[float]) -> str:
    return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"


def layout(row: dict) -> str:
    """N_MP,N_EP,N_ESP, with ``e`` where the EP groups are in a node (Section IV-A case 3)."""
    return (f"{row['n_mp']},{row['n_ep']},{row['n_esp']}"
            + ("" if row.get("esp_in_node", True) else "e"))


def link(row: dict) -> str:
    """Which groups cross the nodes, per schedule (rows of ``bench parm --layouts``): the
    baseline's MoE traffic runs on EP and ESP, S1 / S2's on EP&ESP and MP. "in node" where a
    schedule's traffic never crosses, so the run's bandwidth label does not apply to it."""
    c = row["crosses_nodes"]

    def which(names):
        got = [n.upper().replace("_", "&") for n in names if c[n]]
        return "+".join(got) if got else "**in node**"
    return f"{which(('ep', 'esp'))} / {which(('ep_esp', 'mp'))}"


def bench_rows(res: dict) -> tuple[list[str], list[dict]]:
    out, scored = [], []
    wide = any("crosses_nodes" in row for row in res["rows"])
    out.append("| N_MP,N_EP,N_ESP | " + ("crossing: baseline / S1,S2 | " if wide else "")
               + "k | B L | f | baseline ms | S1 | S2 | auto (Alg. 1's choice, ran) | "
               "S1/S2 time, rounds | decided | Alg. 1 right |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if wide else ""))
    for row in res["rows"]:
        s = row["samples_ms"]
        base = s["baseline"]
        s2_over_s1 = paired(s["s2"], s["s1"])           # > 1: S1 faster
        mp = row["n_mp"]
        decided = mp > 1 and (min(s2_over_s1) > 1 or max(s2_over_s1) < 1)
        faster = "s1" if statistics.median(s2_over_s1) > 1 else "s2"
        right = ""
        if decided:
            right = "yes" if row["auto_choice"] == faster else "no"
            scored.append({"faster": faster, "choice": row["auto_choice"], "n_mp": mp})
        out.append(
            f"| {layout(row)} | " + (f"{link(row)} | " if wide else "") + f"{row['top_k']} | "
            f"{row['tokens_per_rank']} | {row['capacity_factor']} | "
            f"{statistics.median(base):.0f} | {cell(paired(base, s['s1']))} | "
            f"{cell(paired(base, s['s2']))} | {cell(paired(base, s['auto']))} "
            f"({row['auto_choice']}" + (f", ran {row['auto_confirmed']}"
                                         if row.get("auto_confirmed") else "")
            + f") | {cell(s2_over_s1)} | "
            f"{('yes, ' + faster) if decided else ('n/a (N_MP=1)' if mp == 1 else 'no')} | "
            f"{right} |")
    by_layout: dict[str, dict[str, list[float]]] = {}
    for row in res["rows"]:
        s, key = row["samples_ms"], layout(row)
        for v in [v for v in ("s1", "s2", "ted", "ted-r4", "auto") if v in s]:   # newer runs
            by_layout.setdefault(key, {}).setdefault(v, []).append(
                statistics.median(paired(s["baseline"], s[v])))
    for key, per in by_layout.items():
        out.append(f"layout {key}: mean of the rows' median speedups over the baseline "
                   + ", ".join(f"{v} {statistics.mean(r):.2f}x (rows {min(r):.2f}-{max(r):.2f})"
                               for v, r in per.items()))
    return out, scored


CANDIDATES = ("s1", "s2", "ted", "ted-r4")


def score_choice(row: dict, key: str = "auto_choice") -> str | None:
    """Algorithm 1's choice (``key="auto_confirmed"``: the measured auto's) against every other
    candidate the row timed (module docstring): "right", "wrong (X faster)" or "tie"; None
    where the choice was not recorded or not timed as a column."""
    s, choice = row["samples_ms"], row.get(key)
    if choice not in s or choice not in CANDIDATES:
        return None
    others = [c for c in CANDIDATES if c in s and c != choice]
    beaten = [c for c in others if min(paired(s[choice], s[c])) > 1]    # c faster every round
    if beaten:
        return "wrong (" + ", ".join(beaten) + " faster)"
    if all(max(paired(s[choice], s[c])) < 1 for c in others):
        return "right"
    return "tie"


def confirmed(row: dict) -> str:
    """The schedule the measured auto ran, with the confirmation's medians (ms) per candidate
    and its wall time; "-" in rows recorded before it."""
    if row.get("auto_confirmed") is None:
        return "-"
    ms = ", ".join(f"{c} {t:.0f}" for c, t in row.get("auto_measured_ms", {}).items())
    cut = row.get("auto_confirm_cut") or []
    return (f"{row['auto_confirmed']} (measured ms: {ms}"
            + (f"; not measured: {', '.join(cut)}" if cut else "")
            + f"; {row.get('auto_confirm_s', 0):.1f} s)")


def compare_rows(res: dict) -> list[str]:
    labels = res["deepspeed_labels"] + [
        v for v in ("baseline", "s1", "s2", "ted", "ted-r4", "auto")
        if v in res["rows"][0]["samples_ms"]]
    ds = res["deepspeed_labels"][0]
    out = [f"deepspeed {res['deepspeed_version']}, {res['topology']}; speedup over DeepSpeed's "
           "layer per round, median (min-max)",
           "| B L | f | DeepSpeed ms | " + " | ".join(labels[1:])
           + " | Alg. 1 took | Alg. 1 vs the other candidates | auto ran (measured) | "
           "measured auto vs the others |",
           "|---|---|---|" + "---|" * (len(labels) + 3)]
    for row in res["rows"]:
        s = row["samples_ms"]
        out.append(f"| {row['tokens_per_rank']} | {row['capacity_factor']} | "
                   f"{statistics.median(s[ds]):.0f} | "
                   + " | ".join(cell(paired(s[ds], s[v])) for v in labels[1:])
                   + f" | {row.get('auto_choice', '-')} | {score_choice(row) or '-'} | "
                   f"{confirmed(row)} | {score_choice(row, 'auto_confirmed') or '-'} |")
    for c in res.get("numeric_check", []):
        for name in res["deepspeed_labels"]:
            d = c[name]
            out.append(f"numeric check B L {c['tokens_per_rank']} vs {name}: max|y diff| "
                       f"{d['max_abs_diff_output']:.1e}, max|dx diff| "
                       f"{d['max_abs_diff_input_grad']:.1e}: "
                       + ("AGREE" if d["agrees"] else "DIFFER"))
    return out


def main(paths: list[str]) -> None:
    scored_all, all_scores, measured_scores = [], [], []
    for path in paths:
        res = json.load(open(path))
        all_scores += [v for v in map(score_choice, res["rows"]) if v is not None]
        measured_scores += [v for v in (score_choice(r, "auto_confirmed") for r in res["rows"])
                            if v is not None]
        # capacity_padding: recorded since the option (bench parm --capacity-padding); older
        # files ran Parm padded
        trimmed = sorted({v for r in res["rows"] for v, t in r.get("trimmed", {}).items() if t})
        print(f"### {path}\n{res['topology']}  capacity_padding="
              f"{res.get('capacity_padding', '- (Parm padded)')}"
              + (f", trimmed: {', '.join(trimmed)}" if trimmed else ""))
        if "deepspeed_version" in res:
            print("\n".join(compare_rows(res)))
        else:
            lines, scored = bench_rows(res)
            scored_all += scored
            print("\n".join(lines))
        print()
    for what, scores in (("Algorithm 1", all_scores), ("auto (measured)", measured_scores)):
        if scores:
            tally = {k: sum(v.startswith(k) for v in scores) for k in ("right", "wrong", "tie")}
            print(f"{what} against every timed candidate: {tally['right']} right, "
                  f"{tally['wrong']} wrong, {tally['tie']} ties, of {len(scores)} rows")
    if scored_all:
        right = sum(s["faster"] == s["choice"] for s in scored_all)
        s1 = sum(s["faster"] == "s1" for s in scored_all)
        s2_cases = [s for s in scored_all if s["faster"] == "s2"]
        print(f"Algorithm 1 on decided N_MP > 1 cases: {right}/{len(scored_all)}; "
              f"always S1: {s1}/{len(scored_all)}; cases where S2 was faster: {len(s2_cases)}, "
              f"Algorithm 1 right on {sum(s['choice'] == 's2' for s in s2_cases)}")


if __name__ == "__main__":
    main(sys.argv[1:])
