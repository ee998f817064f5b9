"""``moeflow bench spag-overlap``: how much of the early spAG the attention forward hides
(HECATE Section 3.2 and Fig. 1c: FSSDP launches the block's SparseAllGather before the
attention so that it overlaps it), for each spAG transport (``MoEConfig.fssdp.transport``).

One GPT block (:class:`moeflow.models.gpt.Block`: attention, then an FSSDP MoE layer whose
``P'`` is set by hand, every expert replicated on ``replicas`` random other ranks, seeded). Per
transport, three variants are timed round-robin (interleaved with the other transport's), each
repetition with the ranks aligned and the slowest rank's time:

* ``spag``: ``prefetch()`` then wait for it (the spAG alone, on the layer's lane);
* ``attention``: the block's ``attn(ln1(x))`` forward alone;
* ``early``: ``prefetch()``, the attention forward, then wait for the spAG (the block's order).

``hidden = (spag + attention - early) / spag`` from the medians is the share of the spAG that
the early issue took off the critical path (1: fully hidden; 0: none; the three medians come
from the same interleaved run); the same per repetition (its three adjacent timings, paired)
gives the spread, min / median / max. The ``early`` variant also records the spAG and the attention
on a :class:`~moeflow.schedule.executor.Timeline` (the spAG as a ``comm`` task stamped on its
lane, the attention as a ``compute`` task); ``timeline_overlap`` is
:meth:`Timeline.overlap_fraction`, the share of the spAG's own interval during which the
attention ran, median over repetitions of the ranks' mean. Both are reported: the timeline
figure says how long the two ran side by side, the wall-clock one how much time that saved.

``--backward`` (:func:`backward_worker`): the block's forward + backward with the spRS on the
critical path against the spRS on the lane under the attention backward
(``MoEConfig.fssdp.overlap_backward``, Section 3.2), interleaved.

``--regather`` (:func:`regather_worker`): HECATE-RM's re-gathering spAG on the critical path
(at the start of the MoE layer's backward) against launched on the lane when the next block's
attention backward starts (``MoEConfig.fssdp.overlap_regather``, Section 3.2): an FSSDP block
followed by a dense block, the backward timed (after an untimed forward), interleaved, with the re-gather's spAG alone
and the next block's attention backward alone for scale. ``hidden``: 1 - the host time the
MoE layer's backward spent on the re-gather with the overlap (waiting for it) over the same
without it (running it), per repetition (paired), min / median / max (slowest rank of each);
and the wall-clock saving (sync - overlapped backward) over the spAG alone.
"""

from __future__ import annotations

import os
import statistics

import torch

from benchmarks.hecate.spag import random_holders
from moeflow.devices import host_all_reduce
from moeflow.measure.timing import slowest, start_aligned
from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
from moeflow.schedule.executor import Timeline
from moeflow.schedule.streams import Clock
from moeflow.schedule.tasks import Task
from moeflow.topology import Topology

VARIANTS = ("spag", "attention", "early")


def _block(opts: dict, topo: Topology, transport: str, **fssdp):
    from moeflow.config import ModelConfig
    from moeflow.models.gpt import Block

    world = topo.world_size
    cfg = ModelConfig(vocab_size=64, seq_len=opts["seq_len"], d_model=opts["d_model"],
                      n_layers=1, n_heads=opts["n_heads"], d_ff=4 * opts["d_model"],
                      moe_every=1, seed=3,
                      moe=dict(num_experts=opts["experts_per_rank"] * world,
                               d_expert=opts["d_expert"], top_k=1, capacity_factor=None,
                               placement="fssdp",
                               fssdp=dict(materialize="manual", transport=transport, **fssdp)))
    block = Block(cfg, 0, topo)
    experts: FSSDPExperts = block.ffn.experts
    holders = random_holders(cfg.moe.num_experts, world, experts.owners, opts["replicas"], seed=17)
    experts.set_holders(holders)
    return block, experts, holders


def bench_worker(opts: dict) -> dict:
    topo = Topology.from_env()
    dev = torch.device("cpu")
    torch.manual_seed(1 + topo.rank)
    blocks = {t: _block(opts, topo, t) for t in opts["transports"]}
    x = torch.randn(opts["batch"], opts["seq_len"], opts["d_model"])
    clock = Clock(dev)

    def attention(block):
        return block.attn(block.ln1(x))

    def run(transport: str, variant: str, timeline: Timeline | None):
        block, experts, _ = blocks[transport]
        lane = block.ffn.lane
        if variant == "attention":
            attention(block)
            return
        experts.prefetch(lane, timeline)
        if variant == "early":
            t0 = clock.stamp()
            attention(block)
            if timeline is not None:
                timeline.add(Task("attention", 0), "forward", "compute", t0, clock.stamp(), 0)
        experts.wait_prefetched()

    times = {(t, v): [] for t in opts["transports"] for v in VARIANTS}
    overlap = {t: [] for t in opts["transports"]}
    for i in range(opts["warmup"] + opts["reps"]):
        for transport in opts["transports"]:
            for variant in VARIANTS:
                timeline = Timeline() if variant == "early" else None
                watch = start_aligned(topo, dev)
                run(transport, variant, timeline)
                t = slowest(watch.stop(), topo)
                if i < opts["warmup"]:
                    continue
                times[transport, variant].append(t)
                if timeline is not None:
                    frac = timeline.overlap_fraction()
                    overlap[transport].append(
                        host_all_reduce([frac], "sum", topo.world_group)[0] / topo.world_size
                        if topo.distributed else frac)
    rows = []
    for transport in opts["transports"]:
        _, experts, holders = blocks[transport]
        med = {v: statistics.median(times[transport, v]) for v in VARIANTS}
        hidden = (med["spag"] + med["attention"] - med["early"]) / med["spag"]
        paired = [(s + a - e) / s for s, a, e in zip(*(times[transport, v] for v in VARIANTS))]
        moved = sum(len(h) - 1 for h in holders) * experts.expert_bytes
        for v in VARIANTS:
            ts = [1e3 * t for t in times[transport, v]]
            rows.append({"transport": transport, "variant": v, "ms": 1e3 * med[v],
                         "min_ms": min(ts), "max_ms": max(ts), "samples_ms": ts})
        rows.append({"transport": transport, "variant": "summary", "hidden": hidden,
                     "hidden_paired_min": min(paired),
                     "hidden_paired_median": statistics.median(paired),
                     "hidden_paired_max": max(paired),
                     "timeline_overlap": statistics.median(overlap[transport]),
                     "timeline_overlap_samples": overlap[transport], "bytes_moved": moved})
    return {"topology": repr(topo), "options": opts, "rows": rows}


def backward_worker(opts: dict) -> dict:
    """``--backward``: one block's forward + backward (early spAG, the loss ``out.square()
    .mean()``) with the spRS on the critical path (``overlap_backward=False``) and on the
    lane under the attention backward (``True``), interleaved; and the spRS alone (the same
    ``P'``, gradient-sized chunks) for scale, in alternating order (ABC, CBA, ...). Slowest
    rank, min / median / max, and the paired ratio (sync / overlapped) per repetition."""
    from moeflow.comm.sparse import SparseReduceScatter

    topo = Topology.from_env()
    dev = torch.device("cpu")
    torch.manual_seed(1 + topo.rank)
    blocks = {}
    for overlap in (False, True):
        block, experts, holders = _block(opts, topo, opts["transports"][0],
                                         overlap_backward=overlap)   # same weights and P'
        blocks[overlap] = (block, experts)
    x = torch.randn(opts["batch"], opts["seq_len"], opts["d_model"])
    _, ex = blocks[False]
    p0, p1 = ex.owners.owner_chunks(), ex.owners.materialize(holders).holder_chunks()
    sprs = SparseReduceScatter(p1, p0, (ex.numel,), ex.slots.dtype, group=topo.world_group,
                               verify=False)
    grads = {e: torch.randn(ex.numel) for e, h in enumerate(holders) if topo.rank in h}

    def step(overlap: bool):
        block, _ = blocks[overlap]
        block.zero_grad(set_to_none=True)
        block(x).square().mean().backward()

    names = {"sync": lambda: step(False), "overlapped": lambda: step(True),
             "spRS alone": lambda: sprs(grads)}
    times = {n: [] for n in names}
    for i in range(opts["warmup"] + opts["reps"]):
        order = list(names.items())
        for name, fn in (order if i % 2 == 0 else order[::-1]):   # ABC CBA: no order bias
            watch = start_aligned(topo, dev)
            fn()
            t = slowest(watch.stop(), topo)
            if i >= opts["warmup"]:
                times[name].append(t)
    ratio = [a / b for a, b in zip(times["sync"], times["overlapped"])]
    rows = [{"variant": n, "ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
             "max_ms": 1e3 * max(ts), "samples_ms": [1e3 * t for t in ts]}
            for n, ts in times.items()]
    rows.append({"variant": "summary", "sync_over_overlapped": statistics.median(ratio),
                 "sync_over_overlapped_min": min(ratio), "sync_over_overlapped_max": max(ratio),
                 "sprs_on_lane": {"sync": blocks[False][1].sprs_on_lane,
                                  "overlapped": blocks[True][1].sprs_on_lane}})
    return {"topology": repr(topo), "options": opts, "backward": True, "rows": rows}


def _two_blocks(opts: dict, topo: Topology, **fssdp):
    """An FSSDP block (attention, then the MoE layer with HECATE-RM and hand-set ``P'``, as
    :func:`_block`) and the dense block after it (GPT blocks 1 and 0 of a ``moe_every=2``
    model); the torch seed is fixed, so every call builds the same weights."""
    from moeflow.config import ModelConfig
    from moeflow.models.gpt import Block

    world = topo.world_size
    cfg = ModelConfig(vocab_size=64, seq_len=opts["seq_len"], d_model=opts["d_model"],
                      n_layers=2, n_heads=opts["n_heads"], d_ff=4 * opts["d_model"],
                      moe_every=2, seed=3,
                      moe=dict(num_experts=opts["experts_per_rank"] * world,
                               d_expert=opts["d_expert"], top_k=1, capacity_factor=None,
                               placement="fssdp",
                               fssdp=dict(materialize="manual", transport=opts["transports"][0],
                                          rematerialize=True, **fssdp)))
    torch.manual_seed(11)
    moe, nxt = Block(cfg, 1, topo), Block(cfg, 0, topo)
    experts: FSSDPExperts = moe.ffn.experts
    holders = random_holders(cfg.moe.num_experts, world, experts.owners, opts["replicas"], seed=17)
    experts.set_holders(holders)
    return moe, nxt, holders


def regather_worker(opts: dict) -> dict:
    """``--regather``: an FSSDP block then a dense block, the backward timed after an untimed
    forward (loss ``out.square().mean()``), with HECATE-RM's re-gather on the critical path
    (``overlap_regather=False``) and launched on the lane under the dense block's attention
    backward (``True``); the re-gather's spAG alone (the same ``P'``, the owned rows) and the
    dense block's attention backward alone, for scale. The four in alternating order (ABCD,
    DCBA, ...), ranks aligned, slowest rank. ``hidden`` per repetition: (sync - overlapped) /
    spAG alone."""
    from moeflow.strategies.fssdp.layer_experts import _run_spag, _spag_op

    topo = Topology.from_env()
    dev = torch.device("cpu")
    load = [os.getloadavg()[0]]
    models = {o: _two_blocks(opts, topo, overlap_regather=o) for o in (False, True)}
    torch.manual_seed(1 + topo.rank)
    x = torch.randn(opts["batch"], opts["seq_len"], opts["d_model"])
    moe, nxt, holders = models[False]
    ex = moe.ffn.experts
    p1 = ex.owners.materialize(holders)
    spag = _spag_op(ex.owners, p1, ex.numel, ex.slots.dtype, dev, topo.world_group)
    owned = {e: ex.slots.detach()[i] for e, i in ex.slot_index.items()}
    h = x.clone().requires_grad_()
    g = torch.randn_like(x)

    graph = {}

    def forward(overlap: bool):         # untimed: the graph the timed backward runs
        moe, nxt, _ = models[overlap]
        moe.zero_grad(set_to_none=True)
        nxt.zero_grad(set_to_none=True)
        graph[overlap] = nxt(moe(x), regather=moe.ffn).square().mean()

    setup = {"sync": lambda: forward(False), "overlapped": lambda: forward(True),
             "attention backward": lambda: graph.__setitem__("a", nxt.attn(nxt.ln1(h)))}
    names = {"sync": lambda: graph.pop(False).backward(),
             "overlapped": lambda: graph.pop(True).backward(),
             "spAG alone": lambda: _run_spag(spag, ex.owners, topo.rank, owned),
             "attention backward": lambda: graph.pop("a").backward(g)}
    times = {n: [] for n in names}
    exposed = {False: [], True: []}     # host seconds the layer's backward spent on it
    for i in range(opts["warmup"] + opts["reps"]):
        order = list(names.items())
        for name, fn in (order if i % 2 == 0 else order[::-1]):   # ABCD DCBA: no order bias
            if name in setup:
                setup[name]()
            watch = start_aligned(topo, dev)
            fn()
            t = slowest(watch.stop(), topo)
            if i < opts["warmup"]:
                continue
            times[name].append(t)
            if name in ("sync", "overlapped"):
                e = models[name == "overlapped"][0].ffn.experts.regather_exposed_s
                exposed[name == "overlapped"].append(
                    host_all_reduce([e], "max", topo.world_group)[0] if topo.distributed
                    else e)
    load.append(os.getloadavg()[0])
    saved = [(a - b) / s for a, b, s in zip(times["sync"], times["overlapped"],
                                            times["spAG alone"])]
    hidden = [1 - b / a for a, b in zip(exposed[False], exposed[True])]
    med = {n: statistics.median(ts) for n, ts in times.items()}
    rows = [{"variant": n, "ms": 1e3 * med[n], "min_ms": 1e3 * min(ts),
             "max_ms": 1e3 * max(ts), "samples_ms": [1e3 * t for t in ts]}
            for n, ts in times.items()]
    for o, es in exposed.items():
        rows.append({"variant": "re-gather exposed, " + ("overlapped" if o else "sync"),
                     "ms": 1e3 * statistics.median(es), "min_ms": 1e3 * min(es),
                     "max_ms": 1e3 * max(es), "samples_ms": [1e3 * e for e in es]})
    rows.append({"variant": "summary",
                 "hidden_medians": 1 - statistics.median(exposed[True])
                 / statistics.median(exposed[False]),
                 "hidden_paired_min": min(hidden), "hidden_paired_median":
                 statistics.median(hidden), "hidden_paired_max": max(hidden),
                 "hidden_paired": hidden,
                 "saved_over_spag_medians": (med["sync"] - med["overlapped"])
                 / med["spAG alone"],
                 "saved_over_spag_paired": saved,
                 "regather_on_lane": {"sync": models[False][0].ffn.experts.regather_on_lane,
                                      "overlapped": models[True][0].ffn.experts.regather_on_lane},
                 "bytes_moved": sum(len(h) - 1 for h in holders) * ex.expert_bytes})
    return {"topology": repr(topo), "options": opts, "regather": True, "rows": rows,
            "loadavg_1min_start_end": load}


def _timing_table(res: dict, head: str, width: int, summary) -> str:
    """Rows of median / min / max ms under ``head``, the ``summary`` row as ``summary(row)``."""
    lines = [res["topology"], f"{head:<{width}} {'median ms':>10} {'min':>8} {'max':>8}",
             "-" * 50]
    for r in res["rows"]:
        lines.append(summary(r) if r["variant"] == "summary" else
                     f"{r['variant']:<{width}} {r['ms']:>10.2f} {r['min_ms']:>8.2f} "
                     f"{r['max_ms']:>8.2f}")
    return "\n".join(lines)


def format_regather(res: dict) -> str:
    return _timing_table(res, "backward", 30, lambda r: (
        f"re-gather hidden: {100 * r['hidden_paired_median']:.0f}% of its "
        f"exposed time (paired per repetition, "
        f"{100 * r['hidden_paired_min']:.0f}..{100 * r['hidden_paired_max']:.0f}"
        f"%; from the medians {100 * r['hidden_medians']:.0f}%); backward "
        f"saving / spAG alone {r['saved_over_spag_medians']:.2f} (medians); "
        f"{r['bytes_moved'] / 1e6:.1f} MB moved; launched on the lane "
        f"{r['regather_on_lane']}"))


def format_backward(res: dict) -> str:
    return _timing_table(res, "forward + backward", 20, lambda r: (
        f"sync / overlapped (paired): {r['sync_over_overlapped']:.2f} "
        f"({r['sync_over_overlapped_min']:.2f}..{r['sync_over_overlapped_max']:.2f})"))


def format_result(res: dict) -> str:
    if res.get("backward"):
        return format_backward(res)
    if res.get("regather"):
        return format_regather(res)
    lines = [res["topology"],
             f"{'transport':<10} {'variant':<10} {'median ms':>10} {'min':>8} {'max':>8}",
             "-" * 50]
    for r in res["rows"]:
        if r["variant"] == "summary":
            lines.append(f"{r['transport']:<10} hidden by early issue: {100 * r['hidden']:.0f}% "
                         f"of the spAG (wall clock, medians; per repetition "
                         f"{100 * r['hidden_paired_min']:.0f}..{100 * r['hidden_paired_median']:.0f}"
                         f"..{100 * r['hidden_paired_max']:.0f}%); timeline overlap "
                         f"{100 * r['timeline_overlap']:.0f}%; "
                         f"{r['bytes_moved'] / 1e6:.1f} MB moved")
            continue
        lines.append(f"{r['transport']:<10} {r['variant']:<10} {r['ms']:>10.2f} "
                     f"{r['min_ms']:>8.2f} {r['max_ms']:>8.2f}")
    return "\n".join(lines)


__all__ = ["VARIANTS", "backward_worker", "bench_worker", "format_result", "regather_worker"]
