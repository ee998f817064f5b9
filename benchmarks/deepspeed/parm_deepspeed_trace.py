"""Which collectives DeepSpeed-MoE's layer runs, in order: the MP order of Parm's baseline.

The question is which DeepSpeed version's MP-collective order the Parm paper's baseline (Fig. 3a,
Section IV-A, Eq. 1) matches. This records it by running, not by reading: on gloo ranks in a
layout ``--layout N_MP,N_EP,N_ESP`` (default Parm's Fig. 2, 2,2,2: the MP group is the ESP
group, DeepSpeed's tensor-parallel experts; with N_ESP = 1 the experts are whole, and DeepSpeed
drops the MP duplicates around the all-to-alls), one forward and one backward of the installed
``deepspeed.moe.layer.MoE`` (built by
:func:`benchmarks.deepspeed.parm_deepspeed.build_deepspeed_layer`) and of moeflow's ``baseline``
layer on the same weights, with every ``torch.distributed`` collective wrapped to log its name,
its group's ranks and the number of elements this rank sends. Run it once per DeepSpeed
install and layout, e.g. ``python -m benchmarks.deepspeed.parm_deepspeed_trace`` (0.19.8,
system) and ``/opt/ds081/bin/python -m benchmarks.deepspeed.parm_deepspeed_trace --layout
2,4,1`` (0.8.1, docs/benchmarks/install_deepspeed_081.sh; N_MP x N_EP ranks). Results:
docs/benchmarks/parm.md, "DeepSpeed 0.8.1 itself".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
import torch.distributed as dist

from moeflow.config import MoEConfig
from moeflow.launch import launch_local
from moeflow.layer import MoELayer
from moeflow.topology import Topology

# (name, index of the tensor whose numel is what this rank contributes)
TRACED = {"all_to_all_single": 1, "all_to_all": 1, "all_gather": 1,
          "all_gather_into_tensor": 1, "all_reduce": 0, "reduce_scatter": 1,
          "reduce_scatter_tensor": 1, "all_gather_single": 1, "reduce_scatter_single": 1,
          "broadcast": 0, "isend": 0, "irecv": 0, "send": 0, "recv": 0}


def _dtype(x) -> str | None:
    if isinstance(x, torch.Tensor):
        return str(x.dtype).replace("torch.", "")
    if isinstance(x, (list, tuple)) and x:
        return _dtype(x[0])
    return None


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(t) for t in x)
    return 0


def _wrap(fn, name: str, log: list, phase: list):
    arg = TRACED[name]

    def wrapper(*a, **k):
        group = k.get("group", a[arg + 1] if name == "all_reduce" and len(a) > 2 else None)
        ranks = "world" if group is None else dist.get_process_group_ranks(group)
        x = a[arg] if len(a) > arg else k.get("input", k.get("tensor", k.get("input_tensor")))
        log.append({"phase": phase[0], "op": name, "group": ranks, "elements": _numel(x),
                    "dtype": _dtype(x)})
        return fn(*a, **k)

    return wrapper


@contextlib.contextmanager
def traced(log: list, phase: list):
    """Wrap the ``torch.distributed`` collectives, and the module-level aliases moeflow and
    deepspeed keep of them (``_all_gather = dist.all_gather_into_tensor``); each call appends
    (phase, name, group ranks, elements sent)."""
    originals = {}                               # id -> (name, function)
    for name in TRACED:
        fn = getattr(dist, name, None)
        if fn is not None and id(fn) not in originals:
            originals[id(fn)] = (name, fn)
    wrappers = {i: _wrap(fn, name, log, phase) for i, (name, fn) in originals.items()}
    saved = []                                   # (owner, attribute, original)
    owners = [dist] + [m for n, m in list(sys.modules.items())
                       if m is not None and n.split(".")[0] in ("moeflow", "deepspeed")]
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if getattr(ds_comm, "cdb", None) is not None:   # DeepSpeed's backend keeps bound functions
        owners.append(ds_comm.cdb)
    for mod in owners:
        for attr, value in list(vars(mod).items()):
            if id(value) in originals and value is originals[id(value)][1]:
                saved.append((mod, attr, value))
    try:
        for owner, attr, fn in saved:
            setattr(owner, attr, wrappers[id(fn)])
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def trace_worker(opts: dict) -> dict:
    from benchmarks.deepspeed import parm_deepspeed as pd
    import deepspeed

    mp, ep, esp = opts.get("layout", (2, 2, 2))
    topo = Topology.from_env(ep_size=ep, mp_size=mp, esp_size=esp, esp_in_node=True)
    M, T = opts["d_model"], opts["tokens"]
    cfg = MoEConfig(d_model=M, d_expert=2 * M, num_experts=4, top_k=2, capacity_factor=2.0,
                    parallel_schedule="baseline", seed=1)
    gen = torch.Generator().manual_seed(4000 + topo.rank // topo.mp_size)   # MP: same tokens
    x = torch.randn(T, M, generator=gen)
    ref = MoELayer(cfg, topo)
    ds = pd.build_deepspeed_layer(ref, topo)
    out = {"deepspeed_version": deepspeed.__version__, "layout": [mp, ep, esp],
           "tokens_per_rank": T, "d_model": M,
           "num_experts": 4, "top_k": 2, "capacity_factor": 2.0,
           "capacity_elements_per_rank": 4 * T * M}   # E x C x M, C = k f T / E = T
    for name, run in (("deepspeed", lambda xi: ds(xi)[0]), ("moeflow-baseline", ref)):
        log, phase = [], ["forward"]
        xi = x.clone().requires_grad_()
        dist.barrier()
        with traced(log, phase), pd.no_second_expert_noise():
            y = run(xi)
            phase[0] = "backward"
            y.square().mean().backward()
        out[name] = log
    ref.lane.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.deepspeed.parm_deepspeed_trace",
                                description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16, help="tokens per rank (even)")
    p.add_argument("--d-model", type=int, default=8)
    p.add_argument("--layout", default="2,2,2",
                   help="N_MP,N_EP,N_ESP with N_ESP = N_MP or 1 (DeepSpeed's layouts); "
                        "runs N_MP x N_EP ranks")
    p.add_argument("--out", default=None, help="JSON file for the traces (rank 0's)")
    args = p.parse_args(argv)
    try:
        mp, ep, esp = (int(v) for v in args.layout.split(","))
    except ValueError:
        p.error(f"--layout {args.layout!r}: give three integers N_MP,N_EP,N_ESP, e.g. 2,4,1")
    if esp not in (1, mp) or min(mp, ep) < 1:
        p.error(f"--layout {args.layout}: DeepSpeed's experts are whole (N_ESP = 1) or tensor "
                f"parallel over the MP group (N_ESP = N_MP = {mp}); pick one of those")
    if args.tokens < mp or args.tokens % mp:
        p.error(f"--tokens {args.tokens}: pick a multiple of N_MP = {mp} (DeepSpeed splits the "
                f"capacity, here the tokens, over the MP group)")
    res = launch_local(trace_worker, mp * ep,
                       {"tokens": args.tokens, "d_model": args.d_model,
                        "layout": (mp, ep, esp)}, backend="gloo")[0]
    print(f"deepspeed {res['deepspeed_version']}, (N_MP, N_EP, N_ESP) = {tuple(res['layout'])}: "
          "rank 0, one forward + backward, "
          f"E x C x M = {res['capacity_elements_per_rank']} elements per rank")
    for name in ("deepspeed", "moeflow-baseline"):
        print(f"-- {name}")
        for c in res[name]:
            print(f"  {c['phase']:<8} {c['op']:<24} group {c['group']!s:<14} "
                  f"{c['elements']:>7} elements")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
