"""The file and pipe protocol between ``moeflow bench layer --compare torchtitan|megatron`` and
a peer runner (``benchmarks/peers/*_runner.py``) that runs under the peer's own interpreter.

The layer compared is GShard's top-k MoE layer (Lepikhin et al., Section 2.2) with dropless
SwiGLU experts, expert parallel over ``world`` ranks. This module imports nothing but torch
and the standard library: the peer's virtual environment need not hold moeflow.

A **case file** (``torch.save`` of a dict, one per rank) holds what the runner needs to build
the same function as moeflow's layer and to check it:

* ``config``: d_model, d_expert, num_experts, top_k, renormalize (top-k weights divided by
  their sum), threads (torch threads of the moeflow rank), dtype ("fp32" or "bf16"), rank,
  world, first_expert, num_local, port (the peer's own process group rendezvous) and addr;
  optionally input_grad (the timed input needs its gradient too);
* ``router``: ``(M, E)`` float64 router weight (logits ``x @ router``, softmax over all E
  experts, top-k, renormalized: moeflow's ``topk`` router);
* ``w1``, ``w3``: ``(E_local, M, H)``, ``w2``: ``(E_local, H, M)`` float64, this rank's
  experts ``first_expert ..``: ``y = (silu(x w1) * (x w3)) w2`` (SwiGLU, Shazeer 2020 Eq. 6);
* ``x``: ``(T, M)`` float64 input of this rank;
* ``ref_y``, ``ref_dx``: moeflow's float64 output and input gradient of ``mean(y^2)``.

The runner answers on its stdout with lines ``@@peer <json>`` (anything else it prints is the
peer's own log): first ``{"parity": {...}}`` (its float64 function against the reference, and
under ``timed_dtype_error`` its timed layer's error, fp32 or bf16, against the reference), then one
``{"times": [seconds, ...]}`` per ``step N`` line read from its stdin (N forward + backward
steps of ``mean(y^2)``, each the slowest rank's time), until ``quit``; or ``{"error": msg}``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

MARK = "@@peer "
CASE_KEYS = ("config", "router", "w1", "w3", "w2", "x", "ref_y", "ref_dx")
CONFIG_KEYS = ("d_model", "d_expert", "num_experts", "top_k", "renormalize", "threads", "dtype",
               "rank", "world", "first_expert", "num_local", "port", "addr")
# float64 parity: both sides compute in float64, so they agree to round-off
RTOL, ATOL = 1e-9, 1e-11
# the peer's gloo group: a rank missing longer than this fails the runner instead of hanging
GROUP_TIMEOUT_S = 300


def write_case(path: str, case: dict) -> None:
    """Check ``case`` (keys, shapes, float64) and save it at ``path``."""
    check_case(case)
    torch.save({k: case[k] for k in CASE_KEYS}, path)


def read_case(path: str) -> dict:
    case = torch.load(path, weights_only=True)
    check_case(case)
    return case


def check_case(case: dict) -> None:
    """Raise ValueError naming what is missing or of the wrong shape or dtype."""
    missing = [k for k in CASE_KEYS if k not in case]
    if missing:
        raise ValueError(f"peer case lacks {missing}")
    cfg = case["config"]
    lacking = [k for k in CONFIG_KEYS if k not in cfg]
    if lacking:
        raise ValueError(f"peer case config lacks {lacking}")
    m, h, e, el = cfg["d_model"], cfg["d_expert"], cfg["num_experts"], cfg["num_local"]
    t = case["x"].shape[0]
    shapes = {"router": (m, e), "w1": (el, m, h), "w3": (el, m, h), "w2": (el, h, m),
              "x": (t, m), "ref_y": (t, m), "ref_dx": (t, m)}
    for k, shape in shapes.items():
        v = case[k]
        if tuple(v.shape) != shape or v.dtype != torch.float64:
            raise ValueError(f"peer case {k}: {tuple(v.shape)} {v.dtype}, expected {shape} "
                             "float64")
    if cfg["dtype"] not in ("fp32", "bf16"):
        raise ValueError(f"peer case dtype {cfg['dtype']!r}: fp32 or bf16")


def loss_and_grad(forward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, dx)`` of ``mean(y^2)`` for ``forward(x)``, ``x`` a fresh leaf."""
    xi = x.detach().clone().requires_grad_()
    y = forward(xi)
    y.square().mean().backward()
    return y.detach(), xi.grad


def parity(y: torch.Tensor, dx: torch.Tensor, ref_y: torch.Tensor, ref_dx: torch.Tensor,
           rtol: float = RTOL, atol: float = ATOL) -> dict:
    """Max abs and relative L2 differences of outputs and input gradients against the float64
    reference, and whether both are within ``atol + rtol |ref|`` everywhere."""
    out, ok = {}, True
    for what, a, b in (("y", y, ref_y), ("dx", dx, ref_dx)):
        a, b = a.double(), b.double()
        out[f"max_abs_diff_{what}"] = float((a - b).abs().max()) if a.numel() else 0.0
        out[f"rel_l2_diff_{what}"] = float((a - b).norm() / b.norm().clamp_min(1e-300))
        ok &= bool(torch.allclose(a, b, rtol=rtol, atol=atol))
    out["agree"] = ok
    return out


def swiglu_reference(case: dict) -> torch.Tensor:
    """The case's function on one rank without expert parallelism (``world == 1`` only): for
    tests of the protocol and of a runner's weight mapping."""
    cfg = case["config"]
    if cfg["world"] != 1:
        raise ValueError("swiglu_reference holds every expert only when world == 1")
    return lambda x: _swiglu_moe(x, case["router"], case["w1"], case["w3"], case["w2"],
                                 cfg["top_k"], cfg["renormalize"])


def _swiglu_moe(x, router, w1, w3, w2, k, renormalize):
    probs = torch.softmax(x @ router, dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = (experts == e).nonzero(as_tuple=True)
        h = torch.nn.functional.silu(x[tok] @ w1[e]) * (x[tok] @ w3[e])
        y = y.index_add(0, tok, (h @ w2[e]) * weights[tok, slot].unsqueeze(1))
    return y


def timed_step(module: torch.nn.Module, x: torch.Tensor, slowest=None) -> float:
    """Seconds of one forward + backward of ``mean(y^2)`` (the slowest rank's, ``slowest``
    reducing a float over the ranks, after a barrier when it is given); gradients are set to
    None after it, as moeflow's side does."""
    if slowest is not None:
        slowest(0.0)                       # align the ranks
    t = time.perf_counter()
    module(x).square().mean().backward()
    dt = time.perf_counter() - t
    module.zero_grad(set_to_none=True)
    x.grad = None
    return slowest(dt) if slowest is not None else dt


def say(obj: dict) -> None:
    """One protocol line on stdout (flushed: moeflow waits for it)."""
    print(MARK + json.dumps(obj), flush=True)


def serve(step, out=say) -> None:
    """The runner's command loop: ``step N`` runs N timed steps (``step()`` -> seconds) and
    answers their times; ``quit`` (or end of input) returns."""
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            return
        if cmd[0] != "step" or len(cmd) != 2 or not cmd[1].isdigit():
            out({"error": f"unknown command {line.strip()!r}: 'step N' or 'quit'"})
            return
        out({"times": [step() for _ in range(int(cmd[1]))]})


def read_answer(line: str) -> dict | None:
    """The protocol object of a runner's output line, or None for the peer's own log lines."""
    if not line.startswith(MARK):
        return None
    return json.loads(line[len(MARK):])


def _slowest_reducer(world: int):
    """``f(v)`` -> the max of ``v`` over the peer's ranks (identity on one rank)."""
    if world == 1:
        return None
    import torch.distributed as dist

    def slowest(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)
    return slowest


def run(build, argv: list[str], rtol: float = RTOL, atol: float = ATOL) -> int:
    """A runner's main: ``build(case, dtype)`` -> the peer's layer (``module(x) -> y``) holding
    the case's weights, in ``dtype`` ("fp64", "fp32" or "bf16"); ``argv``: ``[case_path]``.
    Starts the peer's own gloo process group when ``world > 1`` (the peer is expert parallel
    over its own ranks), checks float64 parity (``rtol``, ``atol``: the runner's tolerance,
    wider than round-off where the peer rounds through float32 by design), then serves timed
    steps (``input_grad`` in the config: the input needs its gradient too)."""
    import traceback

    try:
        if len(argv) != 1:
            raise ValueError("usage: RUNNER CASE_FILE")
        case = read_case(argv[0])
        cfg = case["config"]
        torch.set_num_threads(cfg["threads"])
        if cfg["world"] > 1:
            from datetime import timedelta

            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://{cfg['addr']}:{cfg['port']}",
                                    rank=cfg["rank"], world_size=cfg["world"],
                                    timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        x = case["x"]
        y, dx = loss_and_grad(build(case, "fp64"), x)
        check = parity(y, dx, case["ref_y"], case["ref_dx"], rtol, atol)
        timed = build(case, cfg["dtype"])
        xt = x.float().requires_grad_(bool(cfg.get("input_grad", False)))
        yt, dxt = loss_and_grad(timed, x.float())
        error = parity(yt, dxt, case["ref_y"], case["ref_dx"])
        error.pop("agree")
        check["timed_dtype_error"] = error
        timed.zero_grad(set_to_none=True)
        say({"parity": check})
        slowest = _slowest_reducer(cfg["world"])
        serve(lambda: timed_step(timed, xt, slowest))
        return 0
    except Exception:                              # noqa: BLE001 - reported to moeflow
        say({"error": traceback.format_exc()})
        return 1
