"""``moeflow bench layer --compare PEER``: moeflow's layer and a peer's, side by side.

Both layers hold the same weights (the peer copies moeflow's, :mod:`moeflow.bench.peer`). First
one untimed check step each on the same input: outputs and input gradients (of
``mean(y^2)``) must agree to ``atol + rtol * |ref|`` (float32 tolerances; reported, and the
run fails when they do not). Then warm-up steps (moeflow's ``"auto"`` settings are tuned in
its first one, so tuning is not timed) and ``reps`` timed repetitions, interleaved (moeflow,
peer, moeflow, peer, ...), every step forward + backward of ``mean(y^2) + aux``
(``input_grad``: the input needs its gradient too, as every MoE layer but a first one's does;
default off: parameter gradients only, as the issue's setups were measured), ranks aligned
by a barrier, a step's time the slowest rank's. Reported: medians, and ``speedup`` = peer's
median / moeflow's median (> 1: moeflow is faster).

After that, ``reps`` more moeflow steps with the phase timer give the phase breakdown, and the
CPU compute efficiency: the layer's executed FLOPs (experts: 12 S M H for S
computed rows, padded capacity slots included, 18 S M H with SwiGLU; router: 6 T M E) per
second, as a fraction of ``torch.matmul``'s FLOP/s on one ``(S, M) x (M, H)`` product (the
FLOPs of the experts' first GEMM as one large matmul) measured in the same run (once before
each of the layer's timed steps); experts alone use the experts phase time, the whole layer the
step time.
"""

from __future__ import annotations

import statistics
import time

import torch

from moeflow.bench.peer import PEERS
from moeflow.bench.peer_process import PROCESS_PEERS
from moeflow.measure.timing import slowest, start_aligned
from moeflow.config import DEFAULT_AUTOTUNE_BUDGET_S, MoEConfig
from moeflow.devices import resolve_device, synchronize
from moeflow.layer import MoELayer
from moeflow.schedule.phase_timer import PhaseTimer
from moeflow.topology import Topology

PHASES = ("route", "permute", "all_to_all", "experts", "combine")
RTOL, ATOL = 1e-4, 1e-5


def all_peers() -> dict:
    """In-process peers and peers under an interpreter of their own
    (:mod:`moeflow.bench.peer_process`), by name."""
    return {**PEERS, **PROCESS_PEERS}


def _step(fn, x: torch.Tensor, topo: Topology, aux: bool = True) -> float:
    watch = start_aligned(topo, x.device)
    y, a = fn(x)
    loss = y.square().mean()
    (loss + a if aux and a is not None else loss).backward()
    x.grad = None
    return slowest(watch.stop(), topo)


def _agreement(layer: MoELayer, peer_fn, x: torch.Tensor, topo: Topology) -> dict:
    """Max abs differences of outputs and input gradients, and whether they are within
    tolerance on every rank."""
    got = {}
    for name, fn in (("moeflow", lambda v: (layer(v), None)), ("peer", peer_fn)):
        xi = x.detach().clone().requires_grad_()
        y, _ = fn(xi)
        y.square().mean().backward()
        got[name] = (y.detach(), xi.grad)
    out = {}
    ok = True
    x = x.detach()
    for i, what in enumerate(("y", "dx")):
        a, b = got["moeflow"][i].float(), got["peer"][i].float()
        out[f"max_abs_diff_{what}"] = slowest(float((a - b).abs().max()), topo)
        ok &= bool(torch.allclose(b, a, rtol=RTOL, atol=ATOL))
        # relative L2 (worst rank): what a lossy codec's error budget bounds (autotune.lossy)
        rel = float((a - b).double().norm() / b.double().norm().clamp_min(1e-30))
        out[f"rel_l2_diff_{what}"] = slowest(rel, topo)
    out["agree"] = slowest(0.0 if ok else 1.0, topo) == 0.0
    return out


def _runner_agreement(layer: MoELayer, ours, x: torch.Tensor, topo: Topology, runner
                      ) -> dict:
    """The runner's float64 parity against moeflow's float64 layer (worst rank), and each
    side's error against that float64 reference in the timed dtype (moeflow: fp32, or bf16
    autocast; the peer: its fp32 or bf16 layer)."""
    from moeflow.bench.peer_process import _float64_reference, _protocol

    proto = _protocol()
    ref_y, ref_dx = _float64_reference(layer, x, proto)
    y, dx = proto.loss_and_grad(lambda v: ours(v)[0], x.detach())
    mine = proto.parity(y.cpu(), dx.cpu(), ref_y, ref_dx)
    theirs = runner.parity
    out = {k: slowest(float(theirs[k]), topo) for k in theirs
           if k.startswith(("max_abs", "rel_l2"))}
    out["agree"] = slowest(0.0 if theirs["agree"] else 1.0, topo) == 0.0
    for side, got in (("moeflow", mine), ("peer", theirs.get("timed_dtype_error"))):
        if got is not None:
            out[f"{side}_error_vs_fp64"] = {k: slowest(float(v), topo) for k, v in got.items()
                                            if k != "agree"}
    return out


def matmul_flops(rows: int, m: int, h: int, times: int, device: torch.device,
                 gen: torch.Generator) -> tuple[float, callable]:
    """``times`` products ``(rows, m) x (m, h)`` (one per local expert: the FLOPs of the
    experts' first forward GEMM) and a function timing them (seconds)."""
    a = torch.randn(rows, m, generator=gen).to(device)
    b = torch.randn(m, h, generator=gen).to(device)

    def once() -> float:
        synchronize(device)
        t = time.perf_counter()
        for _ in range(times):
            torch.matmul(a, b)
        synchronize(device)
        return time.perf_counter() - t
    return 2.0 * rows * m * h * times, once


def layer_flops(layer: MoELayer, tokens: int, trimmed_kept: float | None = None) -> dict:
    """Executed FLOPs of one forward + backward (see the module docstring).
    ``trimmed_kept``: where capacity mode sends only the kept rows
    (``MoEConfig.capacity_padding``), the fraction of the k routing choices kept (1 - the
    layer's ``dropped_fraction``); the experts then compute those rows, not ``E C``."""
    cfg = layer.cfg
    k = cfg.top_k
    if cfg.capacity_factor is None:
        rows_local = tokens * k               # per rank on average (balanced load)
    elif trimmed_kept is not None:
        rows_local = round(tokens * k * trimmed_kept)   # per rank on average, empty slots cut
    else:
        from moeflow.dispatch import capacity
        rows_local = capacity(tokens, k, cfg.num_experts, cfg.capacity_factor) * cfg.num_experts
    per_mm = 2.0 * rows_local * cfg.d_model * cfg.d_expert
    n_mm = 3 if cfg.activation == "swiglu" else 2
    experts = 3 * n_mm * per_mm               # forward 1x, backward 2x
    router = 3 * 2.0 * tokens * cfg.d_model * cfg.num_experts
    return {"expert_flops": experts, "router_flops": router, "rows": rows_local}


def compare_worker(peer_name: str, opts: dict) -> dict:
    topo = Topology.from_env()
    device = resolve_device(opts.get("device", "cpu"))
    peer = all_peers()[peer_name]
    cfg = MoEConfig(d_model=opts["d_model"], d_expert=opts["d_expert"],
                    num_experts=opts["num_experts"], top_k=opts["top_k"],
                    capacity_factor=opts["capacity_factor"], activation=opts["activation"],
                    seed=1, a2a=opts["a2a"], schedule=opts["schedule"],
                    pipeline_degree=opts["pipeline_degree"], codec=opts.get("codec", "none"),
                    lossy_error_budget=opts.get("lossy_error_budget"),
                    placement=opts.get("placement", "ep"),
                    autotune_budget_s=opts.get("autotune_budget_s", DEFAULT_AUTOTUNE_BUDGET_S))
    layer = MoELayer(cfg, topo).to(device)
    peer.check(layer, opts["tokens"])
    gen = torch.Generator().manual_seed(1000 + topo.rank)
    x = torch.randn(opts["tokens"], cfg.d_model, generator=gen).to(device)
    low = opts.get("dtype", "fp32") == "bf16"

    def ours(v):
        with torch.autocast(v.device.type, dtype=torch.bfloat16, enabled=low):
            return layer(v), layer.aux_loss

    runner = None
    if getattr(peer, "in_process", True):
        other = peer.build(layer)

        def theirs(v):
            return peer.forward(other, v)
    else:                        # the peer's own interpreter, driven one step at a time
        runner = peer.start(layer, x, opts["peer_python"], opts.get("dtype", "fp32"),
                            bool(opts.get("input_grad")))
        other = None
    x.requires_grad_(bool(opts.get("input_grad")))   # a later layer's input needs its gradient
    try:
        return _compare(peer_name, opts, topo, device, cfg, layer, x, gen, ours,
                        None if runner else theirs, other, runner)
    finally:
        if runner is not None:
            runner.close()


def _compare(peer_name, opts, topo, device, cfg, layer, x, gen, ours, theirs, other,
             runner) -> dict:
    # the first moeflow forward tunes its auto settings (collectively), before any timing
    _step(ours, x, topo)
    layer.zero_grad(set_to_none=True)
    if runner is None:
        check = _agreement(layer, theirs, x, topo)
        other.zero_grad(set_to_none=True)
    else:
        check = _runner_agreement(layer, ours, x, topo, runner)
    layer.zero_grad(set_to_none=True)
    trims = cfg.capacity_factor is not None and layer.trims_capacity(None, x.device)
    trimmed_kept = 1.0 - layer.stats["dropped_fraction"] if trims else None
    fl = layer_flops(layer, opts["tokens"], trimmed_kept)
    # the reference: one (S, M) x (M, H) product, S = the rows this rank's experts compute
    # (the FLOPs of the experts' first forward GEMM, as one large matmul)
    mm_rows = max(1, fl["rows"])
    mm_flops, mm_once = matmul_flops(mm_rows, cfg.d_model, cfg.d_expert, 1, device, gen)
    times = {"moeflow": [], peer_name: []}
    for i in range(opts["warmup"] + opts["reps"]):
        t = _step(ours, x, topo)
        layer.zero_grad(set_to_none=True)
        if runner is None:
            tp = _step(theirs, x, topo)
            other.zero_grad(set_to_none=True)
        else:                                  # the runner's slowest rank, already
            tp = runner.step()[0]
        if i >= opts["warmup"]:
            times["moeflow"].append(t)
            times[peer_name].append(tp)
    # phase breakdown + CPU efficiency (moeflow only), matmul timed between the steps
    timer, phases, steps, mms = PhaseTimer(), {p: [] for p in PHASES}, [], []
    for _ in range(opts["reps"]):
        mms.append(slowest(mm_once(), topo))
        layer.timer = timer
        timer.reset()
        steps.append(_step(ours, x, topo))
        layer.timer = None
        layer.zero_grad(set_to_none=True)
        for p in PHASES:
            phases[p].append(slowest(timer.forward.get(p, 0.0) + timer.backward.get(p, 0.0),
                                     topo))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    phase_ms = {p: 1e3 * statistics.median(v) for p, v in phases.items()}
    mm_rate = mm_flops / statistics.median(mms)
    # per rank: its experts compute E*C rows (E_local experts x ep*C), its router T tokens
    expert_rate = fl["expert_flops"] / (phase_ms["experts"] / 1e3)
    layer_rate = (fl["expert_flops"] + fl["router_flops"]) / statistics.median(steps)
    tuned = layer.tuned.as_dict() if layer.tuned is not None else None
    return {"peer": peer_name, "topology": repr(topo), "world_size": topo.world_size,
            "tokens_per_rank": opts["tokens"], "config": {k: opts[k] for k in (
                "d_model", "d_expert", "num_experts", "top_k", "capacity_factor",
                "activation", "a2a", "schedule", "pipeline_degree")}
            | {k: opts.get(k) for k in ("codec", "lossy_error_budget", "autotune_budget_s",
                                        "dtype", "placement")},
            "input_grad": x.requires_grad, "threads": torch.get_num_threads(), "warmup": opts["warmup"], "reps": opts["reps"],
            "moeflow_settings": {k: getattr(layer.cfg, k) for k in (
                "placement", "codec", "a2a", "schedule", "pipeline_degree")},
            "tuned": tuned, "agreement": check,
            "step_ms": ms, "samples_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
            "spread_ms": {k: [1e3 * min(v), 1e3 * max(v)] for k, v in times.items()},
            "speedup": ms[peer_name] / ms["moeflow"],
            "phase_ms": phase_ms, "phase_step_ms": 1e3 * statistics.median(steps),
            "efficiency": {"matmul_gflops": mm_rate / 1e9,
                           "experts_gflops": expert_rate / 1e9,
                           "layer_gflops": layer_rate / 1e9,
                           "experts_fraction": expert_rate / mm_rate,
                           "layer_fraction": layer_rate / mm_rate,
                           "matmul_shape": [mm_rows, cfg.d_model, cfg.d_expert]}}


def format_compare(res: dict) -> str:
    p = res["peer"]
    a, e, ms = res["agreement"], res["efficiency"], res["step_ms"]
    s = res["moeflow_settings"]
    lines = [f"{res['topology']}, {res['tokens_per_rank']} tokens/rank, {res['threads']} "
             f"threads/rank, {res['reps']} interleaved reps (medians)",
             f"moeflow ({'' if s.get('placement', 'ep') == 'ep' else s['placement'] + ' / '}"
             f"{s.get('codec', 'none')} / {s['a2a']} / {s['schedule']} / r={s['pipeline_degree']}): "
             f"{ms['moeflow']:.1f} ms   {p}: {ms[p]:.1f} ms   "
             f"speedup {p}/moeflow = {res['speedup']:.3f}",
             f"outputs agree: {a['agree']} (max |dy| {a['max_abs_diff_y']:.2e}, max |dx| "
             f"{a['max_abs_diff_dx']:.2e}; relative L2 y {a.get('rel_l2_diff_y', 0):.2e}, "
             f"dx {a.get('rel_l2_diff_dx', 0):.2e})"
             + (" in float64" if "moeflow_error_vs_fp64" in a else ""),
             *_spread_lines(res),
             "moeflow phases (ms, fwd+bwd): " + ", ".join(
                 f"{k} {v:.1f}" for k, v in res["phase_ms"].items())
             + f"; step {res['phase_step_ms']:.1f}",
             f"CPU efficiency: matmul {e['matmul_gflops']:.1f} GFLOP/s; experts "
             f"{e['experts_gflops']:.1f} GFLOP/s = {e['experts_fraction']:.2f}; whole layer "
             f"{e['layer_gflops']:.1f} GFLOP/s = {e['layer_fraction']:.2f}"]
    t = res.get("tuned")
    if t and t.get("measured_ms") is not None:
        pred = "-" if t["predicted_ms"] is None else f"{t['predicted_ms']:.1f} ms"
        lines.append(f"auto-tuned in {t['tune_s']:.1f} s: predicted {pred},"
                     f" measured {t['measured_ms']:.1f} ms")
        if t.get("codec_error") is not None:
            lines.append(f"codec auto:lossy chose {t['codec']} (error {t['codec_error']:.2e}, "
                         f"budget {t['lossy_error_budget']:g}; errors: " + ", ".join(
                             f"{c} {e:.2e}" for c, e in t["codec_errors"].items()) + ")")
        if t.get("budget_cut"):
            lines.append(f"tuning cut by its {t['budget_s']:g} s budget: "
                         + "; ".join(t["budget_cut"]))
    return "\n".join(lines)


def _spread_lines(res: dict) -> list[str]:
    """The min-max spread of each side's steps, and (process peers) each side's error against
    the float64 reference in the timed dtype."""
    lines = ["spread (min-max ms): " + ", ".join(
        f"{k} {lo:.1f}-{hi:.1f}" for k, (lo, hi) in res.get("spread_ms", {}).items())]
    a, dt = res["agreement"], res["config"].get("dtype") or "fp32"
    for side in ("moeflow", "peer"):
        e = a.get(f"{side}_error_vs_fp64")
        if e:
            who = "moeflow" if side == "moeflow" else res["peer"]
            lines.append(f"{who} {dt} error vs float64: max |dy| {e['max_abs_diff_y']:.2e}, "
                         f"max |dx| {e['max_abs_diff_dx']:.2e}, relative L2 y "
                         f"{e['rel_l2_diff_y']:.2e}, dx {e['rel_l2_diff_dx']:.2e}")
    return lines
