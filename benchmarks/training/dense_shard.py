"""``moeflow bench dense-shard``: per-rank memory of ``moeflow train`` with the dense part
replicated vs sharded by FSDP2 (``--dense-shard replicate | fsdp``; docs/training.md,
"Sharding the dense part with FSDP2").

Each (mode, repetition) is a fresh launch of ``nproc`` gloo ranks (a process's peak resident
set only grows), the modes interleaved within each repetition. Every rank records its resident
set (``VmRSS`` of ``/proc/self/status``) before building the Trainer, builds it (the GPT of the
preset, FSDP2 applied for ``fsdp``), runs ``warmup + steps`` training steps
(``Trainer.train_step``: forward, backward, gradient sync, clipping, AdamW), and reports:

* ``peak_rss``: its peak resident set (``VmHWM``, the kernel's high-water mark of the
  process's resident memory: torch has no allocator statistics on CPU), and ``peak_added`` =
  ``peak_rss`` minus the resident set before the Trainer (imports, process group: the same in
  both modes);
* ``state``: the bytes of the parameters, gradients and AdamW moments this rank holds after
  the last step, counted from the tensors (unique storages; an FSDP2 parameter by its local
  shard), split into the experts and the dense part.

The largest rank's numbers count for a launch (step times: the slowest rank's, ranks aligned
by a barrier before each step). ``--modes fsdp`` runs one mode alone (a model too large to
run replicated); the ratios then are left out.

    moeflow bench dense-shard --preset medium --nproc 4 --set n_layers=12 \\
        --set moe.num_experts=4 --set moe.d_expert=2048 --set seq_len=256 --batch-size 1 \\
        --steps 1 --repeats 2 \\
        --out docs/results/training/dense-shard-medium-4rank.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

from benchmarks.training.train_steps import status_bytes, timed_steps

MODES = ("replicate", "fsdp")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds, experts and dense
    part apart (unique storages)."""
    from moeflow.parallel.grad_sync import is_expert_param

    seen: set = set()
    out = {f"{part}_{kind}": 0 for part in ("dense", "expert")
           for kind in ("params", "grads", "optimizer")}

    def add(key: str, t) -> None:
        if t is None or not torch.is_tensor(t):
            return
        st = _local(t).untyped_storage()
        ident = (st.data_ptr(), st.nbytes())
        if ident not in seen:
            seen.add(ident)
            out[key] += st.nbytes()

    for p in model.parameters():
        part = "expert" if is_expert_param(p) else "dense"
        add(f"{part}_params", p)
        add(f"{part}_grads", p.grad)
        for v in opt.state.get(p, {}).values():
            if torch.is_tensor(v) and v.dim() > 0:
                add(f"{part}_optimizer", v)
    return out


def rank_worker(preset: str, overrides: dict, mode: str, batch_size: int, warmup: int,
                steps: int, out_dir: str) -> dict:
    from moeflow.config import TrainConfig, model_preset
    from moeflow.topology import Topology
    from moeflow.trainer import Trainer

    mcfg = model_preset(preset, **overrides)
    tcfg = TrainConfig(steps=warmup + steps, batch_size=batch_size, dense_shard=mode,
                       warmup_steps=0)
    before = status_bytes("VmRSS")
    trainer = Trainer(mcfg, tcfg, out_dir, Topology.from_env(), progress=False)
    built = status_bytes("VmHWM")
    times = timed_steps(trainer, warmup, steps)
    peak = status_bytes("VmHWM")
    return {"times": times, "rss_before": before, "peak_rss_after_build": built,
            "peak_rss": peak, "peak_added": peak - before,
            "state": state_bytes(trainer.model, trainer.opt)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from moeflow.commands.common import add_quota_arg

    p.add_argument("--preset", default="medium", help="model preset (default medium)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=V",
                   help="override a ModelConfig field of the preset (repeatable)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank (default 1)")
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--repeats", type=int, default=2,
                   help="launches per mode, the modes interleaved within each (default 2)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps per launch")
    p.add_argument("--steps", type=int, default=1, help="timed steps per launch (default 1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (with --cpu-per-rank: ceil of it)")
    add_quota_arg(p)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="the --dense-shard modes to launch, interleaved in this order "
                        "(default: replicate fsdp)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run(args: argparse.Namespace, command: str = "moeflow bench dense-shard") -> dict:
    from moeflow.commands.common import parse_overrides, quota_from_args
    from moeflow.config import ModelConfig
    from moeflow.launch import launch_local

    quota = quota_from_args(args)
    overrides = parse_overrides(args.overrides, ModelConfig)
    modes = list(getattr(args, "modes", None) or MODES)
    runs = {m: [] for m in modes}
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode in modes:
                res = launch_local(rank_worker, args.nproc, args.preset, overrides, mode,
                                   args.batch_size, args.warmup, args.steps, tmp,
                                   timeout_s=1200, threads=args.threads, quota=quota)
                ranks = [res[r] for r in sorted(res)]
                step = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
                rec = {"repeat": rep, "step_s": step,
                       "peak_rss_mib": [r["peak_rss"] / mib for r in ranks],
                       "peak_added_mib": [r["peak_added"] / mib for r in ranks],
                       "peak_rss_after_build_mib": [r["peak_rss_after_build"] / mib
                                                    for r in ranks],
                       "rss_before_mib": [r["rss_before"] / mib for r in ranks],
                       "state_mib": [{k: v / mib for k, v in r["state"].items()}
                                     for r in ranks]}
                runs[mode].append(rec)
                print(f"repeat {rep} {mode:9s} peak RSS {max(rec['peak_rss_mib']):.0f} MiB "
                      f"(added {max(rec['peak_added_mib']):.0f}), dense state "
                      f"{sum(v for k, v in rec['state_mib'][0].items() if k.startswith('dense')):.0f}"
                      f" MiB on rank 0, step {statistics.median(step):.1f} s", flush=True)
    summary = {}
    for mode, rs in runs.items():
        dense = [sum(v for k, v in s.items() if k.startswith("dense"))
                 for r in rs for s in r["state_mib"]]
        expert = [sum(v for k, v in s.items() if k.startswith("expert"))
                  for r in rs for s in r["state_mib"]]
        summary[mode] = {"peak_rss_mib": _spread([max(r["peak_rss_mib"]) for r in rs]),
                         "peak_added_mib": _spread([max(r["peak_added_mib"]) for r in rs]),
                         "peak_rss_after_build_mib": _spread(
                             [max(r["peak_rss_after_build_mib"]) for r in rs]),
                         "dense_state_mib": _spread(dense),
                         "expert_state_mib": _spread(expert),
                         "step_s": _spread([t for r in rs for t in r["step_s"]])}
    if set(MODES) <= set(summary):
        rep_, fsdp = summary["replicate"], summary["fsdp"]
        summary["ratios_fsdp_over_replicate"] = {
            k: fsdp[k]["median"] / rep_[k]["median"]
            for k in ("peak_rss_mib", "peak_added_mib", "peak_rss_after_build_mib",
                      "dense_state_mib")}
    out = {"command": command,
           "args": {k: v for k, v in vars(args).items() if k != "func"},
           "memory_source": "VmHWM / VmRSS of /proc/self/status (peak and current resident "
                            "set; torch has no CPU allocator statistics); state: bytes of the "
                            "tensors held",
           "torch": torch.__version__, "load_avg_end": os.getloadavg(),
           "cpu_per_rank": quota.cpu_per_rank,
           "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out
