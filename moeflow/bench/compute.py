"""``moeflow bench compute``: this device's compute throughput as fitted functions of shape.

The compute counterpart of ``moeflow bench links``: where links fit ``t = alpha + beta * bytes``
per collective, this fits ``t = alpha + beta * work`` per kernel kind, with ``work`` in FLOPs
(matrix products, attention) or bytes (elementwise work, codecs). These are the linear task
models of ScheMoE's profiler (section 4.2) and Parm's cost model (Section V, Eq. 1-14), taken
for the computing tasks, and the compute input of a step simulator.

Kinds (each timed over several shapes, forward and, where a training step runs one, backward):

* ``gemm``: ``x (m, d) @ w (d, h)``, ``2 m d h`` FLOPs; ``gemm_backward`` (dx and dw, twice).
* ``experts``: the built-in expert FFN (``ExpertFFN``: grouped over ``E`` local experts with
  equal row counts, the kernel moeflow's layer runs), ``2 * rows * (2 d h)`` FLOPs (``3`` with
  SwiGLU); ``experts_backward``: twice that.
* ``attention``: causal ``scaled_dot_product_attention``, counted as ``4 B H L^2 Dh`` FLOPs
  (the nominal count; causal kernels may skip half); ``attention_backward``: twice that.
* ``elementwise``: GELU over a tensor, bytes read plus bytes written.
* ``codec:NAME``: encode + decode of a ``(rows, d)`` payload, bytes of the input.

On CUDA each repetition is timed with CUDA events (:class:`moeflow.devices.Stopwatch`), on CPU
with the host clock, after warm-up; the fit is over the medians. JSON schema
(``"schema": "moeflow.compute/1"``)::

    {"schema": "moeflow.compute/1", "device": "cpu", "dtype": "float32", "threads": 1,
     "run_meta": {...},
     "fits": [{"kind": "gemm", "unit": "flop", "alpha_s": 2e-5, "beta_s_per_unit": 1.1e-11,
               "throughput_per_s": 9.1e10, "r2": 0.999, "max_rel_err": 0.08,
               "points": [[work, median_seconds, {"m": 64, "d": 1024, "h": 4096}], ...]}]}
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from moeflow.measure.linkmodel import fit_alpha_beta
from moeflow.comm.codecs import CODECS
from moeflow.devices import Stopwatch, synchronize
from moeflow.experts.ffn import ExpertFFN

SCHEMA = "moeflow.compute/1"
DEFAULT_ROWS = "64,256,1024,4096"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}


def _median_time(fn: Callable[[], object], device: torch.device, warmup: int, reps: int,
                 prepare: Callable[[], object] | None = None) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after ``warmup``; ``prepare`` (untimed)
    runs before each call (a backward's forward)."""
    times = []
    for i in range(warmup + reps):
        if prepare is not None:
            prepare()
        synchronize(device)
        watch = Stopwatch(device).start()
        fn()
        seconds = watch.stop()
        if i >= warmup:
            times.append(seconds)
    return statistics.median(times)


def _backward(make: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> Callable:
    """A closure timing only the backward of ``make()``'s graph (the forward runs outside)."""
    state = {}

    def prepare():
        out = make()
        state["out"], state["grad"] = out, torch.ones_like(out)

    def run():
        torch.autograd.grad(state["out"], params, state["grad"])

    return prepare, run


def _points(rows: list[int], d: int, h: int, experts: int, heads: int,
            dtype: torch.dtype, device: torch.device, activation: str, codecs: list[str]):
    """(kind, unit, [(work, callable, backward_prepare or None, shape), ...]) per measured kind."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, grad=False):
        t = torch.randn(*shape, generator=g, dtype=torch.float32).to(device, dtype)
        return t.requires_grad_(grad)

    out = []
    gemm, gemm_b = [], []
    for m in rows:
        x, w = rand(m, d, grad=True), rand(d, h, grad=True)
        gemm.append((2 * m * d * h, lambda x=x, w=w: x @ w, None, {"m": m, "d": d, "h": h}))
        prep, run = _backward(lambda x=x, w=w: x @ w, [x, w])
        gemm_b.append((4 * m * d * h, run, prep, {"m": m, "d": d, "h": h}))
    out += [("gemm", "flop", gemm), ("gemm_backward", "flop", gemm_b)]

    ffn = ExpertFFN(d, h, 0, experts, activation).to(device, dtype)
    mats = 3 if activation == "swiglu" else 2
    exp, exp_b = [], []
    for m in rows:
        per = max(1, m // experts)
        x = rand(per * experts, d, grad=True)
        counts = [per] * experts
        flops = 2 * per * experts * mats * d * h
        shape = {"rows": per * experts, "experts": experts, "d": d, "h": h}
        exp.append((flops, lambda x=x, c=counts: ffn(x, c), None, shape))
        prep, run = _backward(lambda x=x, c=counts: ffn(x, c), [x, *ffn.parameters()])
        exp_b.append((2 * flops, run, prep, shape))
    out += [("experts", "flop", exp), ("experts_backward", "flop", exp_b)]

    att, att_b = [], []
    dh = max(1, d // heads)
    for m in rows:
        seq = min(m, 1024)
        batch = max(1, m // seq)
        q, k, v = (rand(batch, heads, seq, dh, grad=True) for _ in range(3))

        def fwd(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        flops = 4 * batch * heads * seq * seq * dh
        shape = {"batch": batch, "heads": heads, "seq": seq, "head_dim": dh}
        att.append((flops, fwd, None, shape))
        prep, run = _backward(fwd, [q, k, v])
        att_b.append((2 * flops, run, prep, shape))
    out += [("attention", "flop", att), ("attention_backward", "flop", att_b)]

    elem = []
    for m in rows:
        x = rand(m, h)
        elem.append((2 * x.numel() * x.element_size(), lambda x=x: F.gelu(x), None,
                     {"rows": m, "cols": h}))
    out.append(("elementwise", "byte", elem))

    for name in codecs:
        codec = CODECS[name]()
        pts = []
        for m in rows:
            x = rand(m, d)
            pts.append((x.numel() * x.element_size(),
                        lambda x=x, c=codec: c.decode(c.encode(x), x.dtype), None,
                        {"rows": m, "cols": d}))
        out.append((f"codec:{name}", "byte", pts))
    return out


def measure(rows: list[int], d: int, h: int, experts: int = 8, heads: int = 8,
            dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
            activation: str = "gelu", codecs: list[str] | None = None, warmup: int = 2,
            reps: int = 5, progress: Callable[[str], None] | None = None) -> dict:
    """Time every kind at every row count and fit ``t = alpha + beta * work`` per kind."""
    if len(rows) < 2 or any(r <= 0 for r in rows):
        raise ValueError(f"bench compute --rows {rows}: give at least 2 positive row counts "
                         "(e.g. 64,256,1024,4096) to fit a line through")
    device = torch.device(device)
    fits = []
    kinds = _points(rows, d, h, experts, heads, dtype, device, activation,
                    codecs if codecs is not None else ["fp16", "int8"])
    for kind, unit, pts in kinds:
        measured = []
        for work, fn, prepare, shape in pts:
            if prepare is None:
                with torch.no_grad():
                    t = _median_time(fn, device, warmup, reps)
            else:
                t = _median_time(fn, device, warmup, reps, prepare)
            measured.append([work, t, shape])
            if progress is not None:
                progress(f"{kind} {shape}: {t * 1e3:.3f} ms")
        fit = fit_alpha_beta([p[0] for p in measured], [p[1] for p in measured])
        fits.append({"kind": kind, "unit": unit, "alpha_s": fit.alpha,
                     "beta_s_per_unit": fit.beta,
                     "throughput_per_s": None if fit.beta <= 0 else 1.0 / fit.beta,
                     "r2": fit.r2, "max_rel_err": fit.max_rel_err, "points": measured})
    return {"schema": SCHEMA, "device": device.type, "dtype": str(dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "d_model": d, "d_hidden": h,
            "experts": experts, "heads": heads, "activation": activation, "fits": fits}


def predict(result: dict, kind: str, work: float) -> float:
    """Seconds for ``work`` units of ``kind`` from a ``measure`` result (or its JSON)."""
    for fit in result["fits"]:
        if fit["kind"] == kind:
            return fit["alpha_s"] + fit["beta_s_per_unit"] * work
    known = ", ".join(f["kind"] for f in result["fits"])
    raise KeyError(f"no fit for kind {kind!r} in this compute model (it has: {known})")


def format_table(result: dict) -> str:
    lines = [f"{'kind':<20} {'unit':<5} {'alpha (us)':>11} {'throughput':>14} {'r2':>7} "
             f"{'max rel err':>12}"]
    for f in result["fits"]:
        thr = f["throughput_per_s"]
        scale = "GFLOP/s" if f["unit"] == "flop" else "GB/s"
        thr_s = "inf" if thr is None else f"{thr / 1e9:.2f} {scale}"
        lines.append(f"{f['kind']:<20} {f['unit']:<5} {f['alpha_s'] * 1e6:>11.1f} "
                     f"{thr_s:>14} {f['r2']:>7.4f} {f['max_rel_err']:>12.3f}")
    return "\n".join(lines)
