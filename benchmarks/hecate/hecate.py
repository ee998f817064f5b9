"""``moeflow bench hecate``: one MoE layer under skewed loads, EP against FasterMoE-style
shadowing and FSSDP (HECATE), with per-variant timing, loads, bytes and memory.

Loads are skewed Zipf-like: every token carries a constant feature whose router weights are
``s * log(1 / rank_e)`` (expert ``e``'s popularity rank, a fixed shuffle), so the router's
softmax favours expert ``e`` by ``rank_e^-s`` on top of the random part; the measured loads
(max / mean tokens per rank) are reported, not assumed. Variants, timed round-robin on the same
input (forward + backward + gradient sync; ranks aligned; the slowest rank's time; median):

* ``ep``: static expert parallelism;
* ``shadow``: FasterMoE-style shadowing (:mod:`benchmarks.hecate.shadow`): each step, the current
  global counts (an all-reduce after a gate pass, inside the timed step) pick the ``shadow``
  most loaded experts, held by every rank; owners static;
* ``replace``: SmartMoE-style periodic expert re-placement (:mod:`moeflow.strategies.fssdp.replace`,
  ``fssdp={"replace_every": K}``): ``P' = P`` (EP's data flow) with owners re-assigned from the
  load window after the warm-up and then every ``K`` timed steps (inside the timed step),
  each move carrying the expert's parameters and its Adam moments (zero-filled Adam state is
  attached to the layer's parameters so that the migration moves SmartMoE's bytes);
* ``fssdp static``: FSSDP storage with ``P' = P`` (EP's data flow plus the storage's copies);
* ``fssdp alg1``: materialization only, Algorithm 1 on the load window (``t``, ``m`` given),
  spAG on the critical path (a bare layer has no attention to hide it behind);
* ``fssdp alg1 rm``: the same with re-materialization (a second spAG in the backward);
* ``fssdp alg2``: heterogeneous sharding only: ``P' = P`` with the owners of Algorithm 2
  (Section 4.3, ``t = 0``: every expert placed by load), re-sharded after the warm-up;
* ``hecate``: Algorithm 2 (with ``t``) after the warm-up, then Algorithm 1 each step;
* ``hecate rm``: the same with re-materialization.

With ``reshard_every = k > 0`` the Algorithm 2 variants also re-shard every ``k`` timed steps
(inside the timed step; a Fig. 15b analog needs loads that move: ``drift`` rotates the
popularity ranks every ``drift`` steps).

Per variant: the step time, the all-to-all time (:class:`~moeflow.schedule.phase_timer.PhaseTimer`'s
``all_to_all`` phase, forward + backward, slowest rank), the measured tokens per rank, the
spAG / spRS bytes of all ranks for the last ``P'`` next to Eq. 2's all-reduce volume for the
same placement (``comm.sparse.allreduce_volume``, per group member), and per rank the bytes of
parameters, gradients and Adam state, and of the materialized experts held between forward and
backward (:mod:`benchmarks.hecate.hecate_memory`), measured on one extra step after the timing.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.hecate.hecate_memory import MaterializedProbe, state_bytes
from benchmarks.hecate.shadow import current_loads, shadow_placement
from moeflow.measure.timing import slowest, start_aligned
from moeflow.comm.sparse import allreduce_volume
from moeflow.cases.skewed import case_config, case_input, skew_router
from moeflow.layer import MoELayer
from moeflow.parallel.grad_sync import sync_gradients
from moeflow.schedule.phase_timer import PhaseTimer
from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
from moeflow.strategies.fssdp.replace import rank_loads, replace
from moeflow.strategies.fssdp.reshard import reshard
from moeflow.topology import Topology


def variants(t: int, m: int, reshard_every: list[int] | tuple = (),
             replace_every: int = 5) -> list[tuple[str, dict]]:
    """``(label, MoEConfig overrides)``; the keys ``_shadow`` / ``_alg2`` / ``_replace``
    (bench-only, removed before building the config) ask for shadowing, for Algorithm 2 with
    that ``t`` and for the SmartMoE-style re-placement's migration of Adam state."""
    alg1 = dict(materialize="sparse", overlap_degree=t, memory_capacity=m)
    out = [("ep", {}),
           ("shadow", dict(placement="fssdp", fssdp=dict(materialize="manual"), _shadow=True)),
           ("replace", dict(placement="fssdp", fssdp=dict(replace_every=replace_every),
                            _replace=True)),
           ("fssdp static", dict(placement="fssdp")),
           ("fssdp alg1", dict(placement="fssdp", fssdp=alg1)),
           ("fssdp alg1 rm", dict(placement="fssdp", fssdp={**alg1, "rematerialize": True})),
           ("fssdp alg2", dict(placement="fssdp", _alg2=0)),
           ("hecate", dict(placement="fssdp", fssdp=alg1, _alg2=t)),
           ("hecate rm", dict(placement="fssdp", fssdp={**alg1, "rematerialize": True},
                              _alg2=t))]
    for k in reshard_every:
        out.append((f"hecate reshard/{k}", dict(placement="fssdp", fssdp=alg1, _alg2=t,
                                               _every=k)))
    return out


def _config(v: dict) -> dict:
    return {k: x for k, x in v.items() if not k.startswith("_")}


def skew(layer: MoELayer, s: float, rotation: int = 0, loads=None) -> None:
    """:func:`skew_router` on the layer's router."""
    skew_router(layer.router, layer.cfg.num_experts, s, rotation, loads)


def read_router_loads(spec: str) -> tuple[list[int], str]:
    """``PATH:RUN:LAYER`` of a ``moeflow bench router-load`` JSON -> (that run's
    per-expert loads of that MoE layer after training, a description)."""
    import json

    path, run, layer = spec.rsplit(":", 2)
    data = json.loads(open(path).read())
    entry = data[int(run)]
    return entry["loads_after"][int(layer)], (f"{path} run {entry['run']} (step "
                                              f"{entry['step']}) MoE layer {layer}")


def _step(layer: MoELayer, x: torch.Tensor, topo: Topology, before=None) -> tuple[float, float]:
    """One timed step: (slowest rank's seconds, slowest rank's all-to-all seconds)."""
    timer = layer.timer
    timer.reset()
    watch = start_aligned(topo, x.device)
    if before is not None:
        before()
    y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()
    sync_gradients(layer, topo)
    elapsed = slowest(watch.stop(), topo)
    a2a = slowest(timer.forward.get("all_to_all", 0.0) + timer.backward.get("all_to_all", 0.0),
                  topo)
    layer.zero_grad(set_to_none=True)
    return elapsed, a2a


def _adam_state(layer: MoELayer) -> torch.optim.Optimizer:
    """An Adam optimizer with zero-filled moments on the layer's parameters (never stepped):
    what a re-placement moves with the experts, as SmartMoE moves their optimizer state."""
    opt = torch.optim.Adam(layer.parameters())
    for p in layer.parameters():
        opt.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}
    return opt


def _before(layer: MoELayer, v: dict, x: torch.Tensor, n_shadow: int, step: int, opt=None):
    """The per-step work a variant does inside its timed step (shadowing's count exchange and
    choice; a periodic re-shard), or None."""
    ex = layer.experts
    if v.get("_shadow"):
        def shadow():
            loads = current_loads(layer.router, x, ex.num_experts, ex.group)
            ex.set_holders(shadow_placement(ex.owners, loads, n_shadow).holders)
        return shadow
    if v.get("_replace"):
        every = ex.options.replace_every
        if step > 0 and step % every == 0:
            return lambda: replace(layer, opt)
        return None
    every = v.get("_every", 0)
    if every and step > 0 and step % every == 0:
        return lambda: reshard(layer, None, t=v["_alg2"])
    return None


def _ep_loads(layers: list[MoELayer], world: int) -> np.ndarray | None:
    """Tokens per rank under EP's even owners, from an FSSDP variant's last global per-expert
    loads (every variant routes the same input with the same router)."""
    for layer in layers:
        ex = layer.experts
        if isinstance(ex, FSSDPExperts) and len(ex.window):
            E = ex.num_experts
            return rank_loads(ex.window._loads[-1], [e // (E // world) for e in range(E)],
                              world)
    return None


def _memory(layer: MoELayer, x: torch.Tensor, topo: Topology) -> dict:
    """One more step with Adam, measuring the tensors held (see hecate_memory)."""
    probe = MaterializedProbe(layer.experts)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-6)
    y = layer(x)
    held = probe.held_bytes()
    rows = probe.rows()
    (y.square().mean() + layer.aux_loss).backward()
    sync_gradients(layer, topo)
    opt.step()
    st = state_bytes(layer, opt)
    layer.zero_grad(set_to_none=True)
    mine = {**st, "materialized_held": held, "materialized_rows": rows}
    if topo.world_size > 1:
        every = [None] * topo.world_size
        dist.all_gather_object(every, mine, group=topo.world_group)
    else:
        every = [mine]
    return {k: [r[k] for r in every] for k in mine}


def bench_worker(opts: dict) -> dict:
    topo = Topology.from_env()
    E = opts["experts_per_rank"] * topo.world_size
    n_shadow = opts.get("shadow", opts["t"])
    drift = opts.get("drift", 0)
    rows = []
    router = opts.get("router_loads")
    for s in list(opts["zipf"]) + (["router"] if router else []):
        real = router if s == "router" else None
        base = case_config(opts["d_model"], opts["d_expert"], E, opts["top_k"])
        vs = variants(opts["t"], opts["m"], opts.get("reshard_every", []),
                      opts.get("replace_every", 5))
        keep = opts.get("variants")
        if keep:
            vs = [(label, v) for label, v in vs if label in keep]
        layers = [MoELayer(base.replace(**_config(v)), topo) for _, v in vs]
        opts_of = [_adam_state(layer) if v.get("_replace") else None
                   for (_, v), layer in zip(vs, layers)]
        for layer in layers:
            skew(layer, s, loads=real)
            layer.timer = PhaseTimer()
        x = case_input(opts["tokens"], opts["d_model"], topo.rank)
        times: list[list[float]] = [[] for _ in vs]
        a2as: list[list[float]] = [[] for _ in vs]
        for i in range(opts["warmup"] + opts["reps"]):
            if i == opts["warmup"]:          # Algorithm 2 / re-placement on the warm-up's loads
                for (_, v), layer, opt in zip(vs, layers, opts_of):
                    if "_alg2" in v:
                        reshard(layer, None, t=v["_alg2"])
                    if v.get("_replace"):
                        replace(layer, opt)
            if drift and i > 0 and i % drift == 0:
                for layer in layers:
                    skew(layer, s, rotation=i // drift, loads=real)
            for (_, v), layer, ts, aa, opt in zip(vs, layers, times, a2as, opts_of):
                step = i - opts["warmup"]
                t, a = _step(layer, x, topo, _before(layer, v, x, n_shadow, step, opt))
                if i >= opts["warmup"]:
                    ts.append(t)
                    aa.append(a)
        labels = [label for label, _ in vs]
        ep_ms = 1e3 * statistics.median(times[labels.index("ep")]) if "ep" in labels \
            else math.nan
        static_loads = _ep_loads(layers, topo.world_size)
        for (label, v), layer, ts, aa in zip(vs, layers, times, a2as):
            ms = 1e3 * statistics.median(ts)
            ex = layer.experts
            loads = ex.last_loads if isinstance(ex, FSSDPExperts) else static_loads
            row = {"zipf_s": s, "variant": label, "step_ms": ms, "speedup_vs_ep": ep_ms / ms,
                   "samples_ms": [1e3 * t for t in ts],
                   "a2a_ms": 1e3 * statistics.median(aa),
                   "a2a_samples_ms": [1e3 * a for a in aa],
                   "max_tokens_per_rank": int(loads.max()),
                   "max_over_mean": float(loads.max() / loads.mean()),
                   "tokens_per_rank": [int(n) for n in loads]}
            if isinstance(ex, FSSDPExperts):
                st = ex.stats()
                holders = ex.last_placement.holder_chunks()
                row.update(spag_bytes=st["spag_bytes_all_ranks"],
                           sprs_bytes=st["sprs_bytes_all_ranks"],
                           eq2_allreduce_bytes_per_member=allreduce_volume(holders,
                                                                          ex.expert_bytes),
                           eq2_allreduce_bytes_all_members=sum(
                               2 * (len(h) - 1) * ex.expert_bytes for h in holders
                               if len(h) > 1),
                           replicas=sum(len(h) - 1 for h in holders),
                           owners=list(ex.owners.owners))
            row["memory_bytes_per_rank"] = _memory(layer, x, topo)
            rows.append(row)
        for layer in layers:
            layer.lane.close()
    return {"topology": repr(topo), "options": opts, "rows": rows}


def _mib(n: float) -> float:
    return n / 2**20


def format_result(res: dict) -> str:
    lines = [res["topology"],
             f"{'zipf s':>6} {'variant':<20} {'ms/step':>9} {'vs ep':>7} {'a2a ms':>8} "
             f"{'max tok':>8} {'max/mean':>8} {'spAG+spRS B':>12} {'Eq.2 B':>12} "
             f"{'P/G/O MiB':>16} {'mat MiB':>8}", "-" * 128]
    for r in res["rows"]:
        sp = r.get("spag_bytes", math.nan) + r.get("sprs_bytes", math.nan)
        eq2 = r.get("eq2_allreduce_bytes_all_members", math.nan)
        mem = r.get("memory_bytes_per_rank")
        pgo = (f"{_mib(max(mem['params'])):.1f}/{_mib(max(mem['grads'])):.1f}/"
               f"{_mib(max(mem['optimizer'])):.1f}" if mem else "-")
        mat = f"{_mib(max(mem['materialized_held'])):.1f}" if mem else "-"
        lines.append(f"{str(r['zipf_s']):>6} {r['variant']:<20} {r['step_ms']:>9.2f} "
                     f"{r['speedup_vs_ep']:>6.2f}x {r.get('a2a_ms', math.nan):>8.2f} "
                     f"{r['max_tokens_per_rank']:>8} "
                     f"{r['max_over_mean']:>8.2f} {sp:>12.0f} {eq2:>12.0f} {pgo:>16} {mat:>8}")
    return "\n".join(lines)


__all__ = ["bench_worker", "format_result", "read_router_loads", "skew",
           "variants"]
