"""``moeflow bench hecate-train``: whole training steps of ``moeflow train``'s model under EP,
FasterMoE-style shadowing, SmartMoE-style re-placement, HECATE and HECATE-RM, interleaved
(HECATE ``hecate.txt`` Section 5.2, Fig. 9 / 10: end-to-end speed-up over EP).

Every rank builds one :class:`~moeflow.trainer.Trainer` per mode over the same model config,
seed and data (only ``placement`` / ``fssdp`` differ), optionally all restored from one
``moeflow train`` checkpoint (``--init-from RUN``: the loads of a trained router, e.g. the
DeepSeek-V3 router without balancing, as skewed as a real run's; checkpoints load across
layouts). Then, for each repetition, every mode runs one ``Trainer.train_step`` (forward,
backward, gradient sync, clipping, AdamW, the mode's re-shard / re-placement), ranks aligned by
a barrier before and after, so a step's time is the slowest rank's; the modes' order rotates by
one per repetition, so no mode always runs first. The ratio over EP is paired per repetition.
Per step and mode it also records the loss (world mean: the modes must agree to float32
accuracy, the same function on the same batches) and the tokens each rank's experts computed
in each MoE layer (the straggler HECATE removes, Section 2), and the CPU seconds the step took
summed over the ranks and the most any rank used (``time.process_time``, this process's
threads: gloo's included), which tells whether the ranks' cores, not the slowest rank, set the
step time.

Modes (``--modes``):

* ``ep``: ``placement="ep"`` (static expert parallelism, moeflow's exchange).
* ``shadow``: FasterMoE (``placement="fssdp"``, ``materialize="manual"``, no early spAG): before
  each MoE layer computes, a gate pass on its input and an all-reduce of the global counts
  (:func:`benchmarks.hecate.shadow.current_loads`) pick the ``--t`` most loaded experts, held by
  every rank; the spAG then runs on the critical path (FasterMoE decides after the gate).
* ``replace``: SmartMoE-style re-placement every ``--replace-every`` steps
  (``fssdp={"replace_every": K}``, :mod:`moeflow.strategies.fssdp.replace`), EP's data flow between.
* ``hecate``: Algorithm 1 (``t = --t``, ``m = --m``) every step, early spAG under the attention,
  Algorithm 2 every ``--reshard-every`` steps.
* ``hecate-rm``: the same with re-materialization (HECATE-RM, Section 3.2).

    moeflow cluster run --nodes 4 --ranks-per-node 2 --inter-bw 1gbit -- \\
        python -m moeflow.cli bench hecate-train --preset tiny --set moe.d_expert=1024 \\
        --init-from RUN --reps 6 --out docs/results/hecate/x.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

MODES = ("ep", "shadow", "replace", "hecate", "hecate-rm")


def mode_overrides(mode: str, t: int, m: int, reshard_every: int, replace_every: int) -> dict:
    """The MoEConfig fields a mode sets (``placement`` and ``fssdp``)."""
    if mode == "ep":
        return {"placement": "ep"}
    if mode == "shadow":
        return {"placement": "fssdp", "fssdp": {"materialize": "manual", "early_gather": False}}
    if mode == "replace":
        return {"placement": "fssdp", "fssdp": {"materialize": "static",
                                                 "replace_every": replace_every}}
    if mode in ("hecate", "hecate-rm"):
        return {"placement": "fssdp",
                "fssdp": {"materialize": "sparse", "overlap_degree": t, "memory_capacity": m,
                          "reshard_every": reshard_every,
                          "rematerialize": mode == "hecate-rm"}}
    raise ValueError(f"--modes has {mode!r}; choose from {', '.join(MODES)}")


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes or modes[0] != "ep" or len(set(modes)) != len(modes):
        raise SystemExit(f"moeflow bench hecate-train: --modes {text!r} is invalid: distinct "
                         f"names out of {', '.join(MODES)}, starting with ep (the reference)")
    return modes


class _Loads:
    """Per-expert counts of a model's routers (this rank's tokens, one row per MoE layer),
    counted by forward hooks while ``on`` (the shadowing gate pass turns it off)."""

    def __init__(self, model) -> None:
        from moeflow.layer import MoELayer

        self.layers = [mod for mod in model.modules() if isinstance(mod, MoELayer)]
        self.on = True
        self.counts = [torch.zeros(mod.cfg.num_experts, dtype=torch.int64)
                       for mod in self.layers]
        for mod, c in zip(self.layers, self.counts):
            mod.router.register_forward_hook(self._hook(c))

    def _hook(self, c: torch.Tensor):
        def hook(_mod, _inp, out) -> None:
            if self.on and torch.is_grad_enabled():
                c.add_(torch.bincount(out.experts.reshape(-1).cpu(), minlength=c.numel()))
        return hook

    def take(self) -> torch.Tensor:
        """(layers, experts) counts since the last call."""
        out = torch.stack(self.counts).clone()
        for c in self.counts:
            c.zero_()
        return out


def _add_shadowing(loads: _Loads, n_shadow: int) -> None:
    """FasterMoE's per-iteration decision (:mod:`benchmarks.hecate.shadow`) as a forward pre-hook
    of every MoE layer: the current global counts pick the shadowed experts before the layer
    gathers them."""
    from benchmarks.hecate.shadow import current_loads, shadow_placement

    for layer in loads.layers:
        def pre(mod, args, kwargs):
            if not torch.is_grad_enabled():         # evaluation: whatever P' is set
                return None
            ex = mod.experts
            loads.on = False
            try:
                counts = current_loads(mod.router, args[0].reshape(-1, mod.cfg.d_model),
                                       ex.num_experts, ex.group)
            finally:
                loads.on = True
            ex.set_holders(shadow_placement(ex.owners, counts, n_shadow).holders)
            return None
        layer.register_forward_pre_hook(pre, with_kwargs=True)


def _rank_tokens(layers, counts: torch.Tensor, world: int) -> list[list[int]]:
    """Tokens each rank's experts computed in each MoE layer in the last step: FSSDP layers'
    own record (``last_loads``: over ``P'``, the same on every rank), EP layers' ``counts``
    summed over each rank's contiguous block of experts (this rank's counts here: the worker
    recomputes EP's rows from the all-reduced counts after the run)."""
    from moeflow.strategies.fssdp.layer_experts import FSSDPExperts

    out = []
    for mod, c in zip(layers, counts):
        ex = getattr(mod, "experts", None)
        if isinstance(ex, FSSDPExperts) and ex.last_loads is not None:
            out.append([int(v) for v in ex.last_loads])
        else:
            out.append([int(v) for v in c.view(world, -1).sum(1)])
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def bench_worker(opts: dict) -> dict:
    """On every rank (or one process): the modes' interleaved steps; the summary (identical
    on every rank)."""
    from moeflow import checkpoint
    from moeflow.config import TrainConfig, model_preset
    from moeflow.topology import Topology
    from moeflow.trainer import Trainer, latest_checkpoint

    topo = Topology.from_env()
    world = topo.world_size
    overrides = opts["overrides"]
    steps = opts["warmup"] + opts["reps"]
    start = 0
    path = None
    if opts.get("init_from"):
        path, start = latest_checkpoint(opts["init_from"])
    tcfg = TrainConfig(steps=start + steps + 1, batch_size=opts["batch_size"],
                       warmup_steps=0, seed=opts["seed"])
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in opts["modes"]:
            moe = {"capacity_factor": None, **overrides.get("moe", {}),
                   **mode_overrides(mode, opts["t"], opts["m"], opts["reshard_every"],
                                    opts["replace_every"])}
            mcfg = model_preset(opts["preset"], **{**overrides, "moe": moe})
            tr = Trainer(mcfg, tcfg, tmp, topo, progress=False)
            if path is not None:
                tr.step = checkpoint.load(str(path), tr.model, tr.opt)
            loads = _Loads(tr.model)
            if mode == "shadow":
                _add_shadowing(loads, opts["t"])
            runs.append({"mode": mode, "trainer": tr, "loads": loads, "times": [],
                         "losses": [], "rank_tokens": [], "expert_counts": [], "cpu": []})
        n = len(runs)
        for i in range(steps):
            for j in range(n):
                r = runs[(i + j) % n]            # rotate the order each repetition
                tr = r["trainer"]
                torch.manual_seed(opts["seed"] + 1000 * tr.step + topo.rank)
                _barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                stats = tr.train_step()
                cpu = time.process_time() - c0
                _barrier()
                dt = time.perf_counter() - t0
                counts = r["loads"].take()
                r["losses"].append(float(stats[0]))
                r["expert_counts"].append(counts)
                r["rank_tokens"].append(_rank_tokens(r["loads"].layers, counts, world))
                if i >= opts["warmup"]:
                    r["times"].append(dt)
                    r["cpu"].append(cpu)
    # the world's loss per step and the global expert counts (one all-reduce per mode)
    out_modes = {}
    for r in runs:
        loss = torch.tensor(r["losses"], dtype=torch.float64)
        cpu = torch.tensor(r["cpu"], dtype=torch.float64)
        cpu_max = cpu.clone()
        counts = torch.stack(r["expert_counts"])            # (steps, layers, experts)
        if dist.is_initialized():
            dist.all_reduce(loss)
            dist.all_reduce(cpu)
            dist.all_reduce(cpu_max, op=dist.ReduceOp.MAX)
            dist.all_reduce(counts)
        loss /= world
        # EP layers' rank tokens need the global counts: recompute them from the sums
        tokens = []
        for s, per_layer in enumerate(r["rank_tokens"]):
            row = []
            for li, toks in enumerate(per_layer):
                if r["mode"] == "ep":
                    toks = [int(v) for v in counts[s, li].view(world, -1).sum(1)]
                row.append(toks)
            tokens.append(row)
        out_modes[r["mode"]] = {"step_s": r["times"], "cpu_s": cpu.tolist(),
                                "cpu_s_max_rank": cpu_max.tolist(),
                                "loss": loss.tolist(),
                                "expert_counts": counts.tolist(), "rank_tokens": tokens}
    return summarize(out_modes, opts, world, start)


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(modes: dict, opts: dict, world: int, start_step: int) -> dict:
    """Ratios over EP paired per repetition, loss agreement, load skew (max/mean over ranks and
    over experts, per MoE layer, medians over the timed steps)."""
    ep = modes["ep"]
    warm = opts["warmup"]
    summary = {}
    for mode, r in modes.items():
        ratios = [e / t for e, t in zip(ep["step_s"], r["step_s"])]
        rank_skew = [max(t) / max(1e-12, float(np.mean(t)))
                     for step in r["rank_tokens"][warm:] for t in step]
        exp_skew = [max(c) / max(1e-12, float(np.mean(c)))
                    for step in r["expert_counts"][warm:] for c in step]
        summary[mode] = {
            "step_ms": _spread([1e3 * t for t in r["step_s"]]),
            "cpu_s_all_ranks": _spread(r["cpu_s"]) if r.get("cpu_s") else None,
            "cpu_s_max_rank": (_spread(r["cpu_s_max_rank"]) if r.get("cpu_s_max_rank")
                               else None),
            "ep_over_mode": _spread(ratios), "ep_over_mode_paired": ratios,
            "rank_tokens_max_over_mean": _spread(rank_skew),
            "expert_max_over_mean": _spread(exp_skew),
            "max_abs_loss_diff_vs_ep": max(abs(a - b) for a, b in zip(r["loss"], ep["loss"])),
            "final_loss": r["loss"][-1]}
    return {"world": world, "opts": opts, "start_step": start_step, "summary": summary,
            "modes": modes}


def format_result(res: dict) -> str:
    lines = [f"{'mode':<10}{'ms/step min/med/max':>24}{'EP / mode med [min-max]':>26}"
             f"{'rank max/mean':>15}{'expert max/mean':>17}{'|dloss| vs EP':>15}"
             f"{'CPU s (ranks)':>15}"]
    for mode, s in res["summary"].items():
        st, q = s["step_ms"], s["ep_over_mode"]
        lines.append(f"{mode:<10}{st['min']:>8.0f}/{st['median']:>6.0f}/{st['max']:>6.0f}"
                     f"{q['median']:>12.2f}x [{q['min']:.2f}-{q['max']:.2f}]"
                     f"{s['rank_tokens_max_over_mean']['median']:>15.2f}"
                     f"{s['expert_max_over_mean']['median']:>17.2f}"
                     f"{s['max_abs_loss_diff_vs_ep']:>15.2e}"
                     + (f"{s['cpu_s_all_ranks']['median']:>15.2f}" if s.get("cpu_s_all_ranks")
                        else ""))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from moeflow.commands.common import add_launch_args

    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=V",
                   help="override a ModelConfig field (repeatable); moe.capacity_factor "
                        "defaults to null (dropless) here")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, ep first (default {','.join(MODES)})")
    p.add_argument("--init-from", default=None, metavar="RUN",
                   help="a moeflow train --out folder: every mode starts from its latest "
                        "checkpoint (parameters, optimizer state, step)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--t", type=int, default=2,
                   help="Algorithm 1's overlap degree t; also the experts shadowing replicates")
    p.add_argument("--m", type=int, default=2, help="Algorithm 1's memory capacity m")
    p.add_argument("--reshard-every", type=int, default=10,
                   help="HECATE's Algorithm 2 every N steps (0: never)")
    p.add_argument("--replace-every", type=int, default=10,
                   help="the SmartMoE-style re-placement every N steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode")
    p.add_argument("--reps", type=int, default=5, help="timed steps per mode (interleaved)")
    p.add_argument("--seed", type=int, default=0, help="TrainConfig.seed (the batches)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_launch_args(p, default_nproc=2)


def run(args: argparse.Namespace) -> int:
    from moeflow.commands.common import parse_overrides, report, run_on_ranks
    from moeflow.config import ModelConfig

    modes = parse_modes(args.modes)
    for name in ("batch_size", "reps", "replace_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench hecate-train: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    for name in ("warmup", "t", "m", "reshard_every"):
        if getattr(args, name) < 0:
            raise SystemExit(f"moeflow bench hecate-train: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 0")
    opts = {k: getattr(args, k) for k in ("preset", "batch_size", "t", "m", "reshard_every",
                                          "replace_every", "warmup", "reps", "seed",
                                          "init_from")}
    opts["modes"] = modes
    opts["overrides"] = parse_overrides(args.overrides, ModelConfig)
    return report(run_on_ranks(bench_worker, args, opts), args, format_result)


__all__ = ["MODES", "bench_worker", "format_result", "mode_overrides", "run", "summarize"]
