"""Where Algorithm 1 (Parm Section V-B, lines 4-5) predicts S2 from the fits a `moeflow bench
parm` result file recorded, for docs/benchmarks/parm.md ("S2's regime").

A prediction, not a measurement: for every N_MP > 1 layout of each file and both fit sets
(``grid``: fitted at the grid's message sizes; ``default``: 16 Ki-256 Ki elements) it
evaluates :func:`moeflow.strategies.parm.algorithm1.algorithm1` over B L in 16 ... 8192,
k in {1, 2, 4}, f in {1, 1.2, 2.4, 4} (M = 256 and E = 2 N_EP, the bench's model) and prints
the fits' terms, the sign of ``beta_o - beta_a2a / N_MP`` (negative: large ``k f`` favours S2,
the paper's regime), how many of the 120 cases line 5 wins and the largest t_D1 / t_D2.

Usage: PYTHONPATH=$PWD python docs/benchmarks/scripts/parm_s2_regime.py FILE.json [...]
"""

from __future__ import annotations

import itertools
import json
import sys

from moeflow.strategies.parm.algorithm1 import algorithm1
from moeflow.strategies.parm.fits import ParmFits

TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TOP_K = (1, 2, 4)
FACTORS = (1.0, 1.2, 2.4, 4.0)
WIDTH = 256


def regime(path: str) -> list[str]:
    lines = []
    for layout, sets in json.load(open(path))["fits"].items():
        mp, ep, esp = (int(v) for v in layout.split(",")[:3])
        if mp == 1:
            continue
        for label in ("grid", "default"):
            if label not in sets:
                continue
            fits = ParmFits.from_json(sets[label])
            cases = [(n, k, f, algorithm1(fits, n, 2 * ep, WIDTH, k, f, esp, mp))
                     for n, k, f in itertools.product(TOKENS, TOP_K, FACTORS)]
            wins = [(n, k, f, round(p.t_d1 / p.t_d2, 2)) for n, k, f, p in cases
                    if p.schedule == "s2"]
            best = max(p.t_d1 / p.t_d2 for *_, p in cases)
            a, o = fits.a2a, fits.overlap
            lines.append(f"{path.split('/')[-1]} ({layout}) {label}: beta_o - beta_a2a / N_MP = "
                         f"{o.beta - a.beta / mp:+.2e} s/element; S2 predicted in {len(wins)}"
                         f"/{len(cases)} cases, max t_D1/t_D2 {best:.2f}; first: {wins[:3]}")
    return lines


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print("\n".join(regime(arg)))
