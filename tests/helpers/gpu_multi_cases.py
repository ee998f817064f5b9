"""Machinery of the multi-GPU suite (``tests/gpu/test_gpu_multi.py``), free of CUDA so that the
same rank workers run on CPU with gloo (``tests/multirank/test_cpu_checks_for_gpu_multi.py``).

Each worker runs on every rank of a job launched by :func:`moeflow.launch.launch_local`
(``backend="cpu:gloo,cuda:nccl"`` on GPUs, one rank per GPU) with ``device`` "cuda" (the rank's
``cuda:LOCAL_RANK``) or "cpu", and ``dtype`` "float32" or "bfloat16" (float32 parameters under
bf16 autocast). It returns float64 CPU copies of its outputs and synchronised gradients, which
the test compares with a float64 one-process reference by relative norm error at
``tests/gpu_cases.COMPUTE_TOL`` (the single-GPU suite's tolerances):

* Parm S1 / S2-SAA / S2-AAS at (N_MP, N_EP, N_ESP) = (2, 1, 1) on 2 ranks and (2, 1, 2) on 4
  (references: ``tests/helpers/parm_sched_cases.py``'s conventions: S2 gates the whole MP-shared batch,
  S1 each of its ``N_MP`` parts as a batch of its own);
* FSSDP on 2 ranks with a skewed ``P'`` (the hot experts held by both ranks);
* one step of the tensor-parallel GPT at mp = 2 on 2 ranks.

Routing is discontinuous: the MoE-layer batches keep only tokens whose top-k choice is decided
at the tested precision (:func:`routing_ok`: top-k set and order), and the GPT routes every token to
every expert (``top_k = num_experts``, dropless), so no token can change experts.
"""

from __future__ import annotations

import contextlib
import os

import torch

from moeflow import Topology, sync_gradients
from moeflow.init import seeded_normal
from tests.helpers import gpu_cases as gc
from tests.helpers import parity
from tests.helpers.fssdp_layer_worker import dense, expert_tensors
from tests.helpers.parm_cases import HIDDEN

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: (N_MP, N_EP, N_ESP) per world size; ESP groups inside the node (every rank on one machine)
PARM_LAYOUTS = {2: (2, 1, 1), 4: (2, 1, 2)}
PARM_SCHEDULES = {"s1": dict(parallel_schedule="s1"), "s2_saa": dict(parallel_schedule="s2"),
                  "s2_aas": dict(parallel_schedule="s2", parm_saa=False)}
PARM_CASES = ("capacity_k2", "dropless_k2")
FSSDP_WORLD = 2
#: (the hot-expert cases are left out: their hot expert's softmax saturates, p = 1 - e^-30, so
#: their router gradient lies below float32's resolution (measured 0.48 relative error of a
#: float32 run on one process) and no relative tolerance holds)
FSSDP_CASES = ("capacity_k2", "dropless_k2")
#: P' on 2 ranks, 8 experts (rank r owns experts 4r..4r+3): experts 2 and 5 held by both
#: ranks (their tokens split between the holders by Sec. 4.4's rule), the rest by their owner
FSSDP_SKEWED = [{0}, {0}, {0, 1}, {0}, {1}, {1, 0}, {1}, {1}]
GPT_MP = 2
#: tokens per batch: 4 x parity.TOKENS (24, 44, 16, 36; unequal on purpose). With parity's
#: 6-11 tokens the router gradient under bf16 autocast, a sum with much cancellation, came to
#: 0.95 of the bf16 tolerance on CPU (4 ranks, S2 capacity_k2)
TOKEN_SCALE = 4


def device_of(device: str) -> torch.device:
    """``cuda`` -> this rank's GPU (``LOCAL_RANK``, made current); ``cpu`` unchanged."""
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device(device)


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.bfloat16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def tolerance(dtype: torch.dtype) -> float:
    return gc.COMPUTE_TOL[dtype]


#: while :func:`check` runs with ``ratios``: the largest relative error / tolerance per key
_RATIOS: dict | None = None


def close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str, key: str) -> None:
    """``gc.assert_close_rel``, recording ``error / tol`` under ``key`` when asked."""
    if _RATIOS is not None:
        _RATIOS[key] = max(_RATIOS.get(key, 0.0), gc.rel_error(got, ref) / tol)
    gc.assert_close_rel(got, ref, tol, what)


# ------------------------------------------------------------------------------ MoE layers

#: relative rounding of a routing probability at the tested precision: under autocast the
#: router's matmul runs in bf16 and its softmax may return bf16 (CPU autocast does), so two
#: probabilities closer than this can tie or swap; in logit space that is an absolute
#: ``log(1 + eps) ~ eps``, on top of ``gc.LOGIT_EPS`` (measured: a token with logits 0.0022 and
#: -0.0041 for its 2nd and 3rd experts picked the 3rd under CPU bf16 autocast)
PROB_EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7}


def routing_ok(layer, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per token: whether its top-k experts *and their order* are decided at ``dtype``'s
    precision: every consecutive pair of its sorted top-(k+1) logits further apart than their
    rounding bounds (twice ``gc.LOGIT_EPS`` relative to ``sum |x_i w_i|``, plus twice
    ``PROB_EPS``). The order matters in capacity mode: slots go in choice-major priority
    (first choices, then second choices, ...), so swapped choices can change what drops."""
    w = layer.router.weight.detach().to(torch.float64)
    x = x.to(torch.float64)
    logits = x @ w
    bound = 2 * gc.LOGIT_EPS[dtype] * (x.abs() @ w.abs()) + 2 * PROB_EPS[dtype]
    k = min(layer.cfg.top_k + 1, layer.cfg.num_experts)
    top = logits.topk(k, dim=1)
    b = bound.gather(1, top.indices)
    return ((top.values[:, :-1] - b[:, :-1]) > (top.values[:, 1:] + b[:, 1:])).all(1)


def robust_batch(name: str, index: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of parity case ``name`` (``TOKEN_SCALE * parity.TOKENS[index]`` tokens,
    float64): only tokens whose routing (top-k set and order) is decided at ``dtype``'s
    precision."""
    layer = parity.make_layer(name, Topology.single())
    tokens = TOKEN_SCALE * parity.TOKENS[index % len(parity.TOKENS)]
    cand = seeded_normal((128 * tokens, parity.D_MODEL), 1.0, "gpu-multi-x", name, index,
                         dtype=torch.float64)
    if parity.CASES[name].get("hot") is not None:
        cand = cand + 3.0 * parity._hot_direction()
    keep = routing_ok(layer, cand, dtype)
    x = cand[keep][:tokens]
    assert x.shape[0] == tokens, f"{name}: only {x.shape[0]} robust tokens"
    g = seeded_normal((tokens, parity.D_MODEL), 1.0, "gpu-multi-g", name, index,
                      dtype=torch.float64)
    return x, g


def run_rank_layer(layer, x, g, topo: Topology, device: torch.device, dtype: torch.dtype,
                   **call) -> dict:
    """Forward + backward of the local loss and ``sync_gradients`` with float32 parameters on
    ``device`` (bf16 autocast for bfloat16); float64 CPU copies of what the test compares."""
    layer = layer.to(device=device, dtype=torch.float32)
    xd = x.to(device=device, dtype=torch.float32).requires_grad_()
    gd = g.to(device=device, dtype=torch.float32)
    with autocast(device, dtype):
        y = layer(xd, **call)
    y_dtype = y.dtype
    y = y.float()
    ((y * gd).sum() / max(1, y.shape[0]) + layer.aux_loss.float()).backward()
    sync_gradients(layer, topo)
    cpu = lambda t: t.detach().to("cpu", torch.float64)   # noqa: E731
    return {"y": cpu(y), "y_dtype": y_dtype, "device": y.device.type, "x_grad": cpu(xd.grad),
            "expert_grads": {k: cpu(v) for k, v in expert_tensors(layer, True).items()},
            "dense_grads": {k: cpu(v) for k, v in dense(layer, True).items()}}


def reference(name: str, batches: list, parts: int = 1, **overrides) -> dict:
    """One process, float64: rank r's batch ``batches[r]`` as ``parts`` batches of their own
    (S1's MP parts; 1 otherwise) on the mean of the ranks' local losses."""
    from moeflow.strategies.parm.s1 import token_rows

    layer = parity.make_layer(name, Topology.single(), **overrides)
    total, ys, xs = 0.0, [], []
    for x, g in batches:
        x = x.clone().requires_grad_()
        outs, auxs = [], []
        for rows in token_rows(x.shape[0], parts):
            outs.append(layer(x[rows.start:rows.stop]))
            auxs.append(layer.aux_loss)
        y = torch.cat(outs)
        total = total + (y * g).sum() / max(1, y.shape[0]) + torch.stack(auxs).mean()
        ys.append(y.detach())
        xs.append(x)
    (total / len(batches)).backward()
    return {"y": ys, "x_grad": [x.grad for x in xs], "expert_grads": expert_tensors(layer, True),
            "dense_grads": dense(layer, True)}


def parm_topology(world: int) -> Topology:
    mp, ep, esp = PARM_LAYOUTS[world]
    return Topology.from_env(ep_size=ep, local_size=world, mp_size=mp, esp_size=esp,
                             esp_in_node=True)


def parm_worker(device: str, dtype: str) -> dict:
    """Every Parm schedule x case on this rank (the batch of its MP group)."""
    dev, dt = device_of(device), DTYPES[dtype]
    topo = parm_topology(int(os.environ["WORLD_SIZE"]))
    out = {"shard": None}
    for schedule, kw in PARM_SCHEDULES.items():
        for case in PARM_CASES:
            layer = parity.make_layer(case, topo, **kw)
            out["shard"] = layer.experts.shard
            x, g = robust_batch(case, topo.rank // topo.mp_size, dt)
            out[schedule, case] = run_rank_layer(layer, x, g, topo, dev, dt)
    return out


def parm_reference(schedule: str, case: str, world: int, dtype: torch.dtype) -> dict:
    mp = PARM_LAYOUTS[world][0]
    batches = [robust_batch(case, r // mp, dtype) for r in range(world)]
    return reference(case, batches, parts=mp if schedule == "s1" else 1)


def fssdp_worker(device: str, dtype: str) -> dict:
    """FSSDP with the skewed ``P'`` on this rank, each case; and the held experts."""
    dev, dt = device_of(device), DTYPES[dtype]
    topo = Topology.from_env(local_size=FSSDP_WORLD)
    out = {}
    for case in FSSDP_CASES:
        layer = parity.make_layer(case, topo, placement="fssdp",
                                  fssdp=dict(materialize="manual"))
        layer.experts.set_holders(FSSDP_SKEWED)
        x, g = robust_batch(case, topo.rank, dt)
        out[case] = run_rank_layer(layer, x, g, topo, dev, dt)
        out[case]["holders"] = [sorted(h) for h in layer.experts.last_placement.holders]
    return out


def fssdp_reference(case: str, dtype: torch.dtype) -> dict:
    return reference(case, [robust_batch(case, r, dtype) for r in range(FSSDP_WORLD)])


def expected_expert(key: tuple, ref: dict, shard: tuple[int, int]) -> torch.Tensor:
    """The reference's gradient of expert tensor ``key = (expert, name)``, sliced to this
    rank's ESP shard of the hidden dimension (``parm_cases.HIDDEN``, minus the expert dim)."""
    value = ref["expert_grads"][key]
    s, shards = shard
    dim = HIDDEN.get(key[1])
    if shards > 1 and dim is not None:
        width = value.shape[dim - 1] // shards
        value = value.narrow(dim - 1, s * width, width)
    return value


def compare_rank(got: dict, ref: dict, rank: int, world: int, tol: float, label: str,
                 shard: tuple[int, int] = (0, 1)) -> None:
    """Rank ``rank``'s output, input gradient (``world`` x the reference's: the reference
    averages the local losses) and synchronised gradients against the reference."""
    close(got["y"], ref["y"][rank], tol, f"{label} rank {rank} output", label)
    close(got["x_grad"], world * ref["x_grad"][rank], tol,
          f"{label} rank {rank} input gradient", label)
    assert got["expert_grads"], label
    # per tensor name, this rank's experts stacked (as the single-GPU suite compares a stacked
    # expert weight): one relative error per weight, not per lightly loaded expert
    for name in sorted({n for _, n in got["expert_grads"]}):
        keys = sorted(k for k in got["expert_grads"] if k[1] == name)
        close(torch.stack([got["expert_grads"][k] for k in keys]),
              torch.stack([expected_expert(k, ref, shard) for k in keys]), tol,
              f"{label} rank {rank} gradient of experts {[e for e, _ in keys]} {name}", label)
    assert got["dense_grads"].keys() == ref["dense_grads"].keys(), label
    for key, value in got["dense_grads"].items():
        close(value, ref["dense_grads"][key], tol, f"{label} rank {rank} gradient of {key}",
              label)


# ------------------------------------------------------------------ the tensor-parallel GPT

def gpt_config():
    """``tests/gpt_tp_cases.CFG`` routing every token to every expert, dropless."""
    from tests.helpers.gpt_tp_cases import CFG

    return CFG.replace(moe=dict(top_k=CFG.moe.num_experts, capacity_factor=None))


def gpt_step(model, dev: torch.device, dt: torch.dtype) -> tuple[torch.Tensor, object]:
    from tests.helpers.gpt_tp_cases import batch

    x, y = batch(0, 0)
    with autocast(dev, dt):
        _, ce = model(x.to(dev), y.to(dev))
    loss = ce.float() + model.aux_loss.float()
    loss.backward()
    return loss


def gpt_worker(device: str, dtype: str) -> dict:
    """One step of the GPT at mp = ``GPT_MP`` (tensor-parallel attention and dense MLP, the
    MoE input replicated over the MP group) on this rank: loss and synchronised gradients,
    with where each parameter sits in the global one (``gpt_tp_cases.locate``)."""
    from moeflow.models import GPT
    from moeflow.parallel.replicas import prepare_model
    from tests.helpers.gpt_tp_cases import locate

    dev, dt = device_of(device), DTYPES[dtype]
    topo = Topology.from_env(ep_size=1, local_size=GPT_MP, mp_size=GPT_MP)
    model = prepare_model(GPT(gpt_config(), topo).to(device=dev, dtype=torch.float32), topo)
    loss = gpt_step(model, dev, dt)
    sync_gradients(model, topo)
    return {"loss": float(loss.detach()), "locate": locate(model),
            "grads": {n: p.grad.detach().to("cpu", torch.float64)
                      for n, p in model.named_parameters()}}


def gpt_reference() -> dict:
    from moeflow.models import GPT

    model = GPT(gpt_config()).double()
    loss = gpt_step(model, torch.device("cpu"), torch.float64)
    return {"loss": float(loss.detach()),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def compare_gpt(got: dict, ref: dict, tol: float, label: str) -> None:
    from tests.helpers.gpt_tp_cases import global_slice

    assert abs(got["loss"] - ref["loss"]) <= tol * abs(ref["loss"]), (label, got["loss"],
                                                                       ref["loss"])
    kinds = {w[0] for w in got["locate"].values()}
    assert "tp" in kinds, (label, kinds)
    for name, value in got["grads"].items():
        want = global_slice(ref["grads"][name], got["locate"][name], name)
        close(value, want, tol, f"{label} gradient of {name}", label)


# ----------------------------------------------------------------------------- one launch

WORKERS = {"parm": parm_worker, "fssdp": fssdp_worker, "gpt": gpt_worker}


def worker(device: str, dtypes: list[str], paths: list[str]) -> dict:
    """``{(path, dtype): that worker's result}`` for every path (keys of ``WORKERS``; on 2
    ranks all of them, on 4 only "parm") and dtype, in one launch."""
    return {(p, d): WORKERS[p](device, d) for d in dtypes for p in paths}


def check(results: dict, world: int, paths: tuple[str, ...] = tuple(WORKERS),
          device: str = "cpu", ratios: dict | None = None) -> list[str]:
    """Every rank's results of :func:`worker` for ``paths`` against the references (and that
    they ran on ``device``; FSSDP's replicas were held as ``FSSDP_SKEWED`` says); returns the
    labels of the comparisons made (for the tests to see that they ran). ``ratios``: a dict
    that receives the largest relative error / tolerance per path, case and dtype."""
    global _RATIOS
    _RATIOS = ratios
    try:
        return _check(results, world, paths, device)
    finally:
        _RATIOS = None


def _check(results: dict, world: int, paths: tuple[str, ...], device: str) -> list[str]:
    done = []
    for (path, dtype) in results[0]:
        if path not in paths:
            continue
        dt, tol = DTYPES[dtype], tolerance(DTYPES[dtype])
        for rank in range(world):
            got = results[rank][path, dtype]
            if path == "gpt":
                # bf16: the residual stream and logits pass two blocks of bf16 matmuls, twice
                # the layer's tolerance (as gpu_cases.check_gpt)
                compare_gpt(got, gpt_reference(), tol * (2 if dt == torch.bfloat16 else 1),
                            f"gpt mp={GPT_MP} {dtype}")
                done.append(f"gpt/{dtype}/{rank}")
                continue
            cases = ([(s, c) for s in PARM_SCHEDULES for c in PARM_CASES] if path == "parm"
                     else FSSDP_CASES)
            for key in cases:
                ref = (parm_reference(*key, world, dt) if path == "parm"
                       else fssdp_reference(key, dt))
                run = got[key]
                # the layer returns its input's dtype (float32) under autocast too
                assert run["y_dtype"] == torch.float32, (path, key, run["y_dtype"])
                assert run["device"] == device, (path, key, run["device"])
                if path == "fssdp":
                    assert run["holders"] == [sorted(h) for h in FSSDP_SKEWED], run["holders"]
                compare_rank(run, ref, rank, world, tol, f"{path} {key} {dtype}",
                             shard=got["shard"] if path == "parm" else (0, 1))
                done.append(f"{path}/{key}/{dtype}/{rank}")
    return done


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.helpers.gpu_multi_cases [--device cuda] [--world 2|4]``: run the workers (all
    paths on 2 ranks, Parm on 4), check them, print the largest error / tolerance ratios."""
    import argparse

    from moeflow.launch import launch_local

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--world", type=int, choices=[2, 4], default=2)
    ap.add_argument("--json", help="also write the ratios to this JSON file")
    a = ap.parse_args(argv)
    paths = list(WORKERS) if a.world == 2 else ["parm"]
    backend = "cpu:gloo,cuda:nccl" if a.device == "cuda" else "gloo"
    got = launch_local(worker, a.world, a.device, list(DTYPES), paths, backend=backend,
                       timeout_s=300)
    ratios: dict = {}
    done = check(got, a.world, tuple(paths), a.device, ratios)
    for key, r in sorted(ratios.items()):
        print(f"{key}: largest error / tolerance {r:.3f}")
    print(f"{len(done)} comparisons on {a.world} ranks ({a.device}) within tolerance")
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump({"command": f"python -m tests.helpers.gpu_multi_cases --device {a.device} "
                                  f"--world {a.world}", "device": a.device, "world": a.world,
                       "comparisons": len(done),
                       "largest_error_over_tolerance": {str(k): round(v, 4)
                                                        for k, v in sorted(ratios.items())}},
                      f, indent=1)


if __name__ == "__main__":
    main()
