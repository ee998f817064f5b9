"""Machinery of the GPU suite (``tests/test_gpu*.py``), free of CUDA so that it imports and is
checked on CPU (``tests/unit/cuda/test_cpu_checks_for_gpu.py``): float64 references, tolerances, the
robust-routing token filter, the GPT comparison and the train command.

Tolerances compare relative norm errors ``||got - ref|| / ||ref||`` against the CPU float64
reference. Compute error: float32 ``1e-5`` (float32 rounding ``6e-8`` per operation, a few
hundred terms per dot product), bfloat16 autocast ``2e-2`` (operands rounded to 8 bits,
``2^-8 = 3.9e-3``, a few roundings in a row). A lossy codec adds its documented bound
(``Codec.error_bound``) evaluated on the payload (:func:`codec_rel_bound`), times 4: two lossy
exchanges per direction, and experts that can amplify an input error up to about 2x.

Routing is a discontinuous function of the logits: a token whose k-th and (k+1)-th logits are
closer than the rounding of the logits at the tested precision may pick another expert, which
is a legitimate result at that precision, not an error. :func:`robust_batch` keeps only tokens
whose top-k choice is decided by more than twice that rounding bound, so the comparison is
tight and deterministic.
"""

from __future__ import annotations

import contextlib
import math

import torch

from moeflow import MoEConfig, MoELayer, Topology
from moeflow.comm.codecs import CODECS
from moeflow.config import ModelConfig
from moeflow.init import seeded_normal
from tests.helpers import parity

D_MODEL, D_EXPERT, TOKENS = 32, 64, 48

#: parity cases run on one GPU (top-k routers; bi-level needs several nodes)
LAYER_CASES = ["capacity_k2", "capacity_k1_tight", "dropless_k2", "swiglu_dropless",
               "hot_expert_capacity", "fine_grained_k4", "bigmac_k8"]
CODEC_NAMES = ["none", "fp16", "bf16", "int8", "fp8", "zfp"]
#: zfp at its default rate 8 has a bound of 2^(emax - 1.75) per block (~30% of the block's
#: largest value), too loose to tell a bug from the codec; rate 16 bounds it by 2^(emax - 9.75)
CODEC_ARGS = {"zfp": dict(rate=16)}
SCHEDULES = [("sequential", 1), ("pipelined", 2), ("optsche", 2)]
COMPUTE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
#: bound on the rounding of a logit ``sum_i x_i w_i`` relative to ``sum_i |x_i w_i|``: bf16
#: rounds both operands and the result (3 * 2^-8 < 2^-6); float32 accumulation of a few
#: hundred terms stays below 2^-16
LOGIT_EPS = {torch.float32: 2.0 ** -16, torch.bfloat16: 2.0 ** -6}


# ------------------------------------------------------------------------- errors, tolerances

def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` in float64 on CPU (absolute when ``ref`` is zero)."""
    got = got.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    assert got.shape == ref.shape, (tuple(got.shape), tuple(ref.shape))
    diff = float((got - ref).norm())
    scale = float(ref.norm())
    return diff / scale if scale > 0 else diff


def assert_close_rel(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    err = rel_error(got, ref)
    assert math.isfinite(err) and err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def codec_bound(name: str, x: torch.Tensor, **args) -> torch.Tensor:
    """The documented per-value error bound of codec ``name`` (``Codec.error_bound``) for the
    ``(rows, cols)`` payload ``x`` (float64)."""
    x = x.detach().to(torch.float64)
    a = x.abs()
    if name == "none":
        return torch.zeros_like(x)
    if name == "fp16":
        return 2.0 ** -11 * a + 2.0 ** -25
    if name == "bf16":
        return 2.0 ** -8 * a
    if name == "int8":
        span = x.amax(1, keepdim=True) - x.amin(1, keepdim=True)
        return (span / 510).expand_as(x) * (1 + 2.0 ** -20)
    if name == "fp8":
        block = CODECS["fp8"]().block
        cols = x.shape[1]
        pad = -cols % block
        amax = torch.nn.functional.pad(a, (0, pad)).view(x.shape[0], -1, block).amax(2)
        amax = amax.repeat_interleave(block, 1)[:, :cols]
        return 2.0 ** -4 * a + 2.0 ** -10 * amax / 448
    if name == "zfp":
        rate = args.get("rate", CODECS["zfp"]().rate)
        cols = x.shape[1]
        pad = -cols % 4
        bmax = torch.nn.functional.pad(a, (0, pad)).view(x.shape[0], -1, 4).amax(2)
        emax = torch.frexp(bmax.clamp_min(1e-300))[1].to(torch.float64)
        b = torch.exp2(emax) * min(4.0, 2.0 ** (4 - (4 * rate - 9) / 4))
        b = torch.where(bmax > 0, b, torch.zeros_like(b))
        return b.repeat_interleave(4, 1)[:, :cols]
    raise KeyError(f"no documented bound for codec {name!r}")


def codec_rel_bound(name: str, x: torch.Tensor) -> float:
    """``||bound|| / ||x||`` of :func:`codec_bound` on the payload ``x``."""
    return float(codec_bound(name, x, **CODEC_ARGS.get(name, {})).norm() /
                 x.detach().to(torch.float64).norm())


def tolerance(dtype: torch.dtype, codec: str, payload: torch.Tensor) -> float:
    return COMPUTE_TOL[dtype] + 4 * codec_rel_bound(codec, payload)


# ------------------------------------------------------------------------------ the MoE layer

def make_layer(name: str, **overrides) -> MoELayer:
    """Parity case ``name`` at the GPU suite's sizes, float64 on CPU (the hot-expert cases
    rigged as in :mod:`tests.helpers.parity`)."""
    spec = {k: v for k, v in parity.CASES[name].items() if k not in ("hot", "tokens")}
    codec = overrides.get("codec", "none")
    cfg = MoEConfig(d_model=D_MODEL, d_expert=D_EXPERT, seed=7, layer_id=3,
                    **{**spec, **overrides})
    layer = MoELayer(cfg, Topology.single()).double()
    if codec in CODEC_ARGS:
        layer.codec = CODECS[codec](**CODEC_ARGS[codec])
        if cfg.codec_backward:
            layer.backward_codec = layer.codec
    hot = parity.CASES[name].get("hot")
    if hot is not None:
        with torch.no_grad():
            layer.router.weight[:, hot] += 10.0 * _hot_direction()
    return layer


def _hot_direction() -> torch.Tensor:
    return torch.ones(D_MODEL, dtype=torch.float64) / D_MODEL ** 0.5


def routing_margin_ok(layer: MoELayer, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per token: whether its top-k experts are the same under any rounding of the logits
    allowed by twice ``LOGIT_EPS[dtype]`` (the lowest chosen logit minus its bound exceeds
    every other logit plus its bound)."""
    w = layer.router.weight.detach().to(torch.float64)
    x = x.to(torch.float64)
    k, e = layer.cfg.top_k, layer.cfg.num_experts
    if k == e:
        return torch.ones(x.shape[0], dtype=torch.bool)
    logits = x @ w
    bound = 2 * LOGIT_EPS[dtype] * (x.abs() @ w.abs())    # per logit, with a factor 2
    chosen = torch.zeros_like(logits, dtype=torch.bool)
    chosen.scatter_(1, logits.topk(k, dim=1).indices, True)
    lowest_in = torch.where(chosen, logits - bound, torch.inf).amin(1)
    highest_out = torch.where(chosen, -torch.inf, logits + bound).amax(1)
    return lowest_in > highest_out


def robust_batch(name: str, dtype: torch.dtype, tokens: int = TOKENS
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, g)`` float64: ``tokens`` inputs of case ``name`` whose routing is decided at
    ``dtype``'s precision, and the weights of the loss."""
    layer = make_layer(name)
    cand = seeded_normal((4 * tokens, D_MODEL), 1.0, "gpu-x", name, dtype=torch.float64)
    if parity.CASES[name].get("hot") is not None:
        cand = cand + 3.0 * _hot_direction()
    keep = routing_margin_ok(layer, cand, dtype)
    x = cand[keep][:tokens]
    assert x.shape[0] == tokens, f"{name}: only {x.shape[0]} robust tokens"
    g = seeded_normal((tokens, D_MODEL), 1.0, "gpu-g", name, dtype=torch.float64)
    return x, g


def run_layer(layer: MoELayer, x: torch.Tensor, g: torch.Tensor, device: str,
              dtype: torch.dtype, param_dtype: torch.dtype | None = None) -> dict:
    """Forward + backward of ``(y * g).sum() / T + aux`` with the layer's parameters in
    ``param_dtype`` (float32 unless float64) on ``device``, under bf16 autocast when
    ``dtype`` is bfloat16. Returns outputs and gradients on CPU."""
    pdt = param_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
    layer = layer.to(device=device, dtype=pdt)
    xd = x.detach().to(device=device, dtype=pdt, copy=True).requires_grad_()
    gd = g.to(device=device, dtype=pdt)
    ctx = (torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
           if dtype == torch.bfloat16 else contextlib.nullcontext())
    with ctx:
        y = layer(xd)
    out_dtype = y.dtype
    loss = (y.to(pdt) * gd).sum() / max(1, y.shape[0]) + layer.aux_loss.to(pdt)
    loss.backward()
    return {"y": y.detach().cpu(), "y_dtype": out_dtype, "y_device": y.device.type, "x_grad": xd.grad.cpu(),
            "aux": layer.aux_loss.detach().cpu(),
            "grads": {n: p.grad.detach().cpu() for n, p in layer.named_parameters()}}


def reference(name: str, x: torch.Tensor, g: torch.Tensor) -> dict:
    """The exact function: float64 on CPU, codec none, sequential."""
    return run_layer(make_layer(name), x, g, "cpu", torch.float64)


def compare_layer(got: dict, ref: dict, tol: float, label: str) -> None:
    assert_close_rel(got["y"], ref["y"], tol, f"{label} output")
    assert_close_rel(got["x_grad"], ref["x_grad"], tol, f"{label} input gradient")
    assert_close_rel(got["aux"], ref["aux"], tol, f"{label} aux loss")
    assert got["grads"].keys() == ref["grads"].keys(), label
    for pname, value in got["grads"].items():
        assert_close_rel(value, ref["grads"][pname], tol, f"{label} gradient of {pname}")


def check_layer(name: str, device: str, dtype: torch.dtype, codec: str = "none",
                schedule: str = "sequential", r: int = 1) -> dict:
    """Case ``name`` with this codec and schedule on ``device`` at ``dtype`` against the CPU
    float64 reference; returns the run (for further checks)."""
    x, g = robust_batch(name, dtype)
    ref = reference(name, x, g)
    layer = make_layer(name, codec=codec, codec_backward=codec != "none", schedule=schedule,
                       pipeline_degree=r)
    got = run_layer(layer, x, g, device, dtype)
    with torch.no_grad():
        payload = layer.dcca.down(x.to(device, torch.float32)).cpu() if layer.dcca else x
    tol = tolerance(dtype, codec, payload)
    compare_layer(got, ref, tol, f"{name} {codec} {schedule} r={r} {dtype} on {device}")
    # the layer returns its input's dtype (float32 here) under autocast too: the gated sum
    # runs in the router's float32 (docs/guide.md, "Autocast")
    want = torch.float32
    assert got["y_dtype"] == want, (got["y_dtype"], want)
    assert got["y_device"] == torch.device(device).type, got["y_device"]
    return got


# ---------------------------------------------------------------------------------- the GPT

def gpt_config(top_k: int, capacity_factor) -> ModelConfig:
    return ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, moe_every=1, seed=5,
                       moe=dict(num_experts=4, d_expert=64, top_k=top_k,
                                capacity_factor=capacity_factor))


GPT_GRADS = ["tok.weight", "blocks.0.attn.qkv.weight", "blocks.0.ffn.router.weight",
             "blocks.0.ffn.experts.w1", "blocks.1.ffn.experts.w2", "ln_f.weight"]


def run_gpt(cfg: ModelConfig, device: str, dtype: torch.dtype) -> dict:
    """Loss (cross-entropy + aux) and a few gradients of the GPT on one batch."""
    from moeflow.models import GPT

    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    model = GPT(cfg).to(device=device, dtype=pdt)
    gen = torch.Generator().manual_seed(11)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen)
    x, y = idx[:, :-1].to(device), idx[:, 1:].to(device)
    ctx = (torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
           if dtype == torch.bfloat16 else contextlib.nullcontext())
    with ctx:
        _, ce = model(x, y)
    loss = ce.to(pdt) + model.aux_loss.to(pdt)
    loss.backward()
    params = dict(model.named_parameters())
    return {"loss": loss.detach().cpu(),
            "grads": {n: params[n].grad.detach().cpu() for n in GPT_GRADS}}


def check_gpt(cfg: ModelConfig, device: str, dtype: torch.dtype) -> None:
    ref = run_gpt(cfg, "cpu", torch.float64)
    got = run_gpt(cfg, device, dtype)
    # bf16: the residual stream and logits pass two blocks of bf16 matmuls: twice the layer's
    tol = COMPUTE_TOL[dtype] * (2 if dtype == torch.bfloat16 else 1)
    label = f"GPT top_k={cfg.moe.top_k} cf={cfg.moe.capacity_factor} {dtype} on {device}"
    assert_close_rel(got["loss"], ref["loss"], tol, f"{label} loss")
    for n in GPT_GRADS:
        assert_close_rel(got["grads"][n], ref["grads"][n], tol, f"{label} gradient of {n}")


# ---------------------------------------------------------------------------- moeflow train

def train_parser_flags() -> set[str]:
    """Option strings of ``moeflow train``'s parser (introspected, not assumed)."""
    import argparse

    from moeflow.commands import train_command as train

    parser = argparse.ArgumentParser()
    train.register(parser.add_subparsers())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices["train"]._actions for s in a.option_strings}


def train_command(out: str, steps: int = 50, device: str = "cuda",
                  flags: set[str] | None = None) -> list[str]:
    """``python -m moeflow.cli train`` on one rank for ``steps`` steps of a small model;
    ``--device``/``--dtype`` only where the parser has them."""
    import sys

    flags = train_parser_flags() if flags is None else flags
    cmd = [sys.executable, "-m", "moeflow.cli", "train", "--preset", "tiny",
           "--steps", str(steps), "--nproc", "1", "--out", out, "--no-progress",
           "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "5",
           "--eval-every", "25", "--eval-batches", "2", "--log-every", "5",
           "--set", "seq_len=64"]
    if "--device" in flags:
        cmd += ["--device", device]
    if "--dtype" in flags and device == "cuda":
        cmd += ["--dtype", "bf16"]
    return cmd


def check_metrics(lines: list[str], steps: int) -> dict:
    """metrics.jsonl of a run: every step's record, the training and validation losses fall.
    Returns the first and last losses."""
    import json

    recs = [json.loads(line) for line in lines if line.strip()]
    assert recs and recs[-1]["step"] == steps, recs[-1:]
    train = [r["loss"] for r in recs if "loss" in r]
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(train) >= 2 and len(val) >= 2, recs
    assert all(math.isfinite(v) for v in train + val), recs
    assert train[-1] < train[0] - 0.3, ("training loss did not fall", train)
    assert val[-1] < val[0] - 0.3, ("validation loss did not fall", val)
    return {"train": (train[0], train[-1]), "val": (val[0], val[-1])}


# ------------------------------------------------------------------- timelines and overlap

def overlapping_pairs(records) -> list[tuple[str, str, float]]:
    """``(A task, E task, seconds)`` for every communication task A1/A2 whose interval
    intersects an expert task E's in the same phase (``Timeline.records``)."""
    comm = [r for r in records if r.lane == "comm" and r.task.kind in ("A1", "A2")]
    experts = [r for r in records if r.lane == "compute" and r.task.kind == "E"]
    out = []
    for a in comm:
        for e in experts:
            if a.phase != e.phase:
                continue
            both = min(a.end, e.end) - max(a.start, e.start)
            if both > 0:
                out.append((f"{a.task.kind}^{a.task.chunk}", f"E^{e.task.chunk}", both))
    return out


def lanes_of(records) -> dict[str, set[str]]:
    """Task kind -> the lanes its records ran on."""
    out: dict[str, set[str]] = {}
    for r in records:
        out.setdefault(r.task.kind, set()).add(r.lane)
    return out


OVERLAP_CFG = dict(d_model=1024, d_expert=4096, num_experts=8, top_k=2, capacity_factor=1.0,
                   schedule="optsche", pipeline_degree=2, seed=0)
OVERLAP_TOKENS = 8192


def overlap_worker(runs: int = 4) -> dict:
    """On each rank of a multi-GPU job: an ``optsche`` r=2 layer on ``cuda:LOCAL_RANK``,
    forward + backward ``runs`` times after one warm-up, recorded with a Timeline. Returns
    picklable records and the overlap fractions."""
    import os

    from moeflow.schedule.executor import Timeline

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    topo = Topology.from_env()
    layer = MoELayer(MoEConfig(**OVERLAP_CFG), topo).cuda()
    gen = torch.Generator().manual_seed(topo.rank)
    x = torch.randn(OVERLAP_TOKENS, OVERLAP_CFG["d_model"], generator=gen).cuda()
    layer.timeline = Timeline()
    for i in range(runs + 1):
        if i == 1:
            torch.cuda.synchronize()
            layer.timeline.clear()
        xi = x.detach().requires_grad_()
        layer(xi).square().mean().backward()
    recs = layer.timeline.records
    return {"records": [(r.task.kind, r.task.chunk, r.phase, r.lane, r.start, r.end)
                        for r in recs],
            "pairs": overlapping_pairs(recs),
            "fraction": {p: layer.timeline.overlap_fraction(p) for p in ("forward", "backward")}}
