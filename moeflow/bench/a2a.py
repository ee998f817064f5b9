"""``moeflow bench a2a``: every registered all-to-all algorithm over small/medium/large messages.

The experiment of ScheMoE section 6.4 / Fig. 9: the time of one all-to-all for messages of
1) small [1K, 1M), 2) medium [1M, 200M) and 3) large [200M, 2G] bytes per rank, for each
algorithm of :data:`moeflow.comm.alltoall.ALLTOALLS` (an algorithm whose ``check_topology``
refuses the layout is skipped with its reason). Reported per size: median time (slowest rank,
ranks aligned by a barrier; 3x the repetitions below 1 MiB), algorithm bandwidth ``bytes / time`` (nccl-tests' algbw; ``bytes`` =
one rank's send buffer) and the ratio to a lower bound:

* several nodes: every node must push ``M * S * (W - M) / W`` bytes through its link
  (``M`` ranks per node, ``W`` ranks, ``S`` bytes per rank, even splits), so
  ``t >= M * S * (W - M) / W / inter_bw``;
* one node: every rank sends ``S * (W - 1) / W`` bytes over the node's loopback,
  ``t >= S * (W - 1) / W / intra_bw``.

The bandwidths come from ``--inter-bw``/``--intra-bw``, else from the emulated cluster's
settings (``MOEFLOW_CLUSTER_*_BW_BPS``, set by ``moeflow cluster run``), else from a ``--links``
fit (``p2p`` of that class, ``1/beta``); without any, the ratio is not reported. The emulator's
``tbf`` counts Ethernet/IP/TCP headers, so about 1.05 is the best ratio reachable on it.

With several nodes, a summary per size sets Pipe-A2A's measured speedup over ``pairwise`` next
to the bound of ScheMoE Eq. 18, ``S_max = (M t1 + (P-M) t2) / max(M t1, (P-M) t2)`` (Eq. 16 over
Eq. 17), where ``t1`` / ``t2`` are the times of one intra- / inter-node send-recv of one block
(``bytes / P``): predicted by the ``--links`` ``p2p`` fit of that class when given, else from the
class's bandwidth above (``block / bw``).
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from moeflow.measure.timing import slowest, start_aligned
from moeflow.comm.alltoall import ALLTOALLS
from moeflow.config import ConfigError
from moeflow.devices import resolve_device
from moeflow.topology import Topology

DEFAULT_SIZES = "1K,64K,512K,4M,32M,128M,256M"
CLASSES = (("small", 0, 1 << 20), ("medium", 1 << 20, 200 << 20), ("large", 200 << 20, 1 << 62))


def size_class(nbytes: int) -> str:
    return next(name for name, lo, hi in CLASSES if lo <= nbytes < hi)


def _shape(nbytes: int, world: int) -> tuple[int, int]:
    """(rows per destination, row width) of a float32 send buffer of about ``nbytes``."""
    elems = max(world, nbytes // 4)
    rows = max(1, elems // (world * 256))        # rows of 1 KiB once the buffer is big enough
    return rows, max(1, elems // (world * rows))


def a2a_worker(names: list[str] | None, sizes: list[int], warmup: int, reps: int,
               device: str = "cpu") -> dict | None:
    """On every rank: time each algorithm at each size (buffers on ``device``, timed with CUDA
    events there); rank 0 returns the results."""
    topo = Topology.from_env()
    dev = resolve_device(device)
    world = topo.world_size
    results, skipped = [], {}
    for name in (names or sorted(ALLTOALLS)):
        cls = ALLTOALLS[name]
        try:
            algo = cls(topo)
        except ConfigError as err:
            skipped[name] = str(err)
            continue
        for nbytes in sizes:
            rows, cols = _shape(nbytes, world)
            x = torch.ones(world * rows, cols, device=dev)
            splits = [rows] * world
            times = []
            n_reps = 3 * reps if nbytes < (1 << 20) else reps   # small: cheap and noisier
            for i in range(warmup + n_reps):
                watch = start_aligned(topo, dev)
                algo.exchange(x, splits, splits)
                elapsed = slowest(watch.stop(), topo)
                if i >= warmup:
                    times.append(elapsed)
            del x
            real = world * rows * cols * 4
            results.append({"algorithm": name, "bytes": real, "class": size_class(real),
                            "median_s": statistics.median(times), "times_s": times})
    if topo.rank != 0:
        return None
    return {"layout": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size,
                       "world": world}, "device": dev.type, "results": results,
            "skipped": skipped}


def bandwidths(inter_bw: float | None, intra_bw: float | None,
               links: str | None) -> dict[str, tuple[float | None, str]]:
    """Bits/s of each class and where it came from (argument, emulator, links fit)."""
    out: dict[str, tuple[float | None, str]] = {}
    fits = None
    if links:
        from moeflow.measure.linkmodel import load_fits
        fits = load_fits(links)
    for cls, given in (("inter", inter_bw), ("intra", intra_bw)):
        env = os.environ.get(f"MOEFLOW_CLUSTER_{cls.upper()}_BW_BPS")
        if given is not None:
            out[cls] = (given, f"--{cls}-bw")
        elif env:
            out[cls] = (float(env), "emulated cluster setting")
        elif fits and (cls, "p2p") in fits and fits[(cls, "p2p")].beta > 0:
            out[cls] = (8 * fits[(cls, "p2p")].bandwidth, f"{links} (p2p fit)")
        else:
            out[cls] = (None, "unknown")
    return out


def add_bounds(data: dict, bws: dict[str, tuple[float | None, str]]) -> None:
    """Add ``algbw_Bps``, ``bound_s`` and ``ratio`` to every result (in place)."""
    n, m = data["layout"]["nodes"], data["layout"]["ranks_per_node"]
    w = n * m
    cls = "inter" if n > 1 else "intra"
    bw, source = bws[cls]
    data["bound"] = {"link": cls, "bw_bps": bw, "source": source,
                     "formula": ("M*S*(W-M)/W / inter_bw" if n > 1 else "S*(W-1)/W / intra_bw")}
    for r in data["results"]:
        s = r["bytes"]
        r["algbw_Bps"] = s / r["median_s"]
        wire = m * s * (w - m) / w if n > 1 else s * (w - 1) / w
        r["bound_s"] = None if bw is None else wire / (bw / 8)
        r["ratio"] = None if bw is None else r["median_s"] / r["bound_s"]


def eq18_speedup(m: int, p: int, t1: float, t2: float) -> float:
    """ScheMoE Eq. 18: the largest speedup of Pipe-A2A over a sequential all-to-all on ``p``
    ranks, ``m`` per node, when one intra-node send-recv takes ``t1`` and an inter-node one ``t2``."""
    if not (0 < m < p) or t1 < 0 or t2 < 0 or (t1 == 0 and t2 == 0):
        raise ValueError(f"eq18_speedup needs 0 < m < p and non-negative times, not both 0; got "
                         f"m={m}, p={p}, t1={t1}, t2={t2}")
    intra, inter = m * t1, (p - m) * t2
    return (intra + inter) / max(intra, inter)


def add_pipe_summary(data: dict, bws: dict[str, tuple[float | None, str]],
                     links: str | None = None) -> None:
    """Add ``data["pipe_vs_pairwise"]``: per size, the measured speedup of ``pipe`` over
    ``pairwise`` next to :func:`eq18_speedup` (several nodes and both algorithms measured)."""
    n, m = data["layout"]["nodes"], data["layout"]["ranks_per_node"]
    p = n * m
    by = {(r["algorithm"], r["bytes"]): r["median_s"] for r in data["results"]}
    if n < 2 or not any(a == "pipe" for a, _ in by) or not any(a == "pairwise" for a, _ in by):
        return
    fits = {}
    if links:
        from moeflow.measure.linkmodel import load_fits
        fits = load_fits(links)

    def one_block(cls: str, block: float) -> tuple[float | None, str]:
        fit = fits.get((cls, "p2p"))
        if fit is not None:
            return fit.predict(block), f"{links} ({cls} p2p fit)"
        bw, source = bws[cls]
        return (None, "unknown") if bw is None else (block / (bw / 8), source)

    rows, src1, src2 = [], "unknown", "unknown"
    for s in sorted({b for a, b in by if a == "pipe" and ("pairwise", b) in by}):
        block = s / p
        (t1, src1), (t2, src2) = one_block("intra", block), one_block("inter", block)
        bound = None if t1 is None or t2 is None else eq18_speedup(m, p, t1, t2)
        rows.append({"bytes": s, "pairwise_s": by[("pairwise", s)], "pipe_s": by[("pipe", s)],
                     "speedup": by[("pairwise", s)] / by[("pipe", s)], "t1_s": t1, "t2_s": t2,
                     "eq18_bound": bound})
    data["pipe_vs_pairwise"] = {"formula": "S_max = (M t1 + (P-M) t2) / max(M t1, (P-M) t2)",
                                "t1_source": src1, "t2_source": src2, "rows": rows}


def format_table(data: dict) -> str:
    b = data["bound"]
    bw = "?" if b["bw_bps"] is None else f"{b['bw_bps'] / 1e9:g} Gbit/s"
    lines = [f"layout {data['layout']['nodes']} nodes x {data['layout']['ranks_per_node']} "
             f"ranks; bound = {b['formula']} with {b['link']} bw {bw} ({b['source']})"]
    head = (f"{'algorithm':12} {'class':7} {'bytes/rank':>11} {'median ms':>10} "
            f"{'algbw MB/s':>11} {'bound ms':>9} {'x bound':>8}")
    lines += [head, "-" * len(head)]
    for r in data["results"]:
        bound = "n/a" if r["bound_s"] is None else f"{r['bound_s'] * 1e3:.3f}"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"{r['algorithm']:12} {r['class']:7} {r['bytes']:>11} "
                     f"{r['median_s'] * 1e3:>10.3f} {r['algbw_Bps'] / 1e6:>11.1f} "
                     f"{bound:>9} {ratio:>8}")
    for name, why in data["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    pipe = data.get("pipe_vs_pairwise")
    if pipe:
        lines += ["", f"Pipe-A2A speedup over pairwise vs ScheMoE Eq. 18 ({pipe['formula']}; "
                  f"t1 from {pipe['t1_source']}, t2 from {pipe['t2_source']})",
                  f"{'bytes/rank':>11} {'pairwise ms':>12} {'pipe ms':>9} {'speedup':>8} "
                  f"{'t1 us':>9} {'t2 us':>9} {'Eq.18':>6}"]
        for r in pipe["rows"]:
            t1 = "n/a" if r["t1_s"] is None else f"{r['t1_s'] * 1e6:.1f}"
            t2 = "n/a" if r["t2_s"] is None else f"{r['t2_s'] * 1e6:.1f}"
            b = "n/a" if r["eq18_bound"] is None else f"{r['eq18_bound']:.2f}"
            lines.append(f"{r['bytes']:>11} {r['pairwise_s'] * 1e3:>12.3f} "
                         f"{r['pipe_s'] * 1e3:>9.3f} {r['speedup']:>8.2f} {t1:>9} {t2:>9} {b:>6}")
    return "\n".join(lines)


def plot(data: dict, path: str) -> None:
    """Time vs. bytes per rank, one line per algorithm and the lower bound (log-log)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("moeflow bench a2a --plot needs matplotlib: "
                         "pip install 'moeflow[plot]' (or pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    algos = sorted({r["algorithm"] for r in data["results"]})
    for name in algos:
        rs = [r for r in data["results"] if r["algorithm"] == name]
        ax.plot([r["bytes"] for r in rs], [r["median_s"] * 1e3 for r in rs], "o-", label=name)
    rs = [r for r in data["results"] if r["algorithm"] == algos[0]] if algos else []
    if rs and rs[0]["bound_s"] is not None:
        ax.plot([r["bytes"] for r in rs], [r["bound_s"] * 1e3 for r in rs], "k--",
                label=f"lower bound ({data['bound']['link']} link)")
    for _, lo, _ in CLASSES[1:]:
        ax.axvline(lo, color="grey", lw=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank (send buffer)")
    ax.set_ylabel("median time (ms)")
    lay = data["layout"]
    ax.set_title(f"all-to-all, {lay['nodes']} nodes x {lay['ranks_per_node']} ranks "
                 "(small | medium | large)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(data: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
