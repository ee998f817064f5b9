"""Summarise tutel_gap_timeline.py's JSON: per layer, the step (slowest rank) and per rank the
time inside all-to-alls, other collectives and outside them; argument: the JSON."""
import json, sys, statistics as st
out = json.load(open(sys.argv[1]))
names = list(out[0])
for nm in names:
    R = len(out); S = len(out[0][nm]["steps"])
    steps = [max(out[r][nm]["step_ms"][i] for r in range(R)) for i in range(S)]
    a2a = []; other = []; gath = []; durs = []
    for r in range(R):
        for s in out[r][nm]["steps"]:
            tot = s["fwd_ms"] + s["bwd_ms"]
            c = sum(e[3] - e[2] for e in s["events"] if e[3] is not None and e[0] == "all_to_all_single")
            g = sum(e[3] - e[2] for e in s["events"] if e[3] is not None and e[0] != "all_to_all_single")
            durs += [round(e[3] - e[2]) for e in s["events"] if e[0] == "all_to_all_single"]
            a2a.append(c); gath.append(g); other.append(tot - c - g)
    print(f"{nm:9s} step(max over ranks) med {st.median(steps):.0f} min {min(steps):.0f} | per rank: in a2a med {st.median(a2a):.0f}, other colls {st.median(gath):.1f}, outside colls med {st.median(other):.0f}")
    print("    a2a durations", sorted(durs))
