"""Summarise `moeflow simulate layer --measured ... --out` files into the validation table of
docs/simulate.md: per layout, the rows, median and max |predicted / measured - 1|, the rows
within 25 %, and the ranking kept (of the pairs of rows whose measured steps differ by more
than 10 %, those the prediction orders the same way); then predicted / measured per row.

Usage: python docs/benchmarks/scripts/sim_validation_summary.py LABEL=FILE[,FILE...] ...
(e.g. 2x2-1gbit=sim-layerA-2x2-1gbit-q045.json,sim-layerB-2x2-1gbit-q045.json); the rows of a
label's second and later files are prefixed "B:".
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys


def rows_of(files: list[str]) -> list[tuple[str, float, float]]:
    """(name, predicted s, measured s) of every row that has a measured twin."""
    out = []
    for i, path in enumerate(files):
        with open(path) as f:
            for r in json.load(f)["results"]:
                if r.get("measured_step_ms") is None:
                    continue
                name = ("B:" if i else "") + r["name"]
                out.append((name, r["step_s"], r["measured_step_ms"] / 1e3))
    return out


def summary(rows: list[tuple[str, float, float]]) -> dict:
    errs = [abs(p / m - 1) for _, p, m in rows]
    apart = kept = 0
    for (_, p1, m1), (_, p2, m2) in itertools.combinations(rows, 2):
        if max(m1, m2) / min(m1, m2) <= 1.10:
            continue
        apart += 1
        kept += (m1 < m2) == (p1 < p2)
    return {"rows": len(rows), "median": statistics.median(errs), "max": max(errs),
            "within25": sum(e <= 0.25 for e in errs), "apart": apart, "kept": kept}


def main(argv: list[str]) -> int:
    table = {}
    for arg in argv:
        label, files = arg.split("=", 1)
        table[label] = rows_of(files.split(","))
    print("| layout | rows | median \\|error\\| | max \\|error\\| | within 25 % | ranking kept |")
    print("|---|---|---|---|---|---|")
    every = []
    for label, rows in table.items():
        s = summary(rows)
        every += rows
        print(f"| {label} | {s['rows']} | {s['median']:.0%} | {s['max']:.0%} | "
              f"{s['within25']}/{s['rows']} | {s['kept']}/{s['apart']} "
              f"({s['kept'] / max(s['apart'], 1):.0%}) |")
    s = summary(every)
    print(f"| all | {s['rows']} | {s['median']:.0%} | {s['max']:.0%} | "
          f"{s['within25']}/{s['rows']} | (per layout) |")
    print()
    names = list(dict.fromkeys(n for rows in table.values() for n, _, _ in rows))
    print("| config | " + " | ".join(table) + " |")
    print("|---|" + "---|" * len(table))
    for n in names:
        cells = []
        for rows in table.values():
            hit = [p / m for name, p, m in rows if name == n]
            cells.append(f"{hit[0]:.2f}" if hit else "-")
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
