"""``moeflow train``: train the MoE GPT (default: the tiny preset on the embedded corpus, on
2 CPU ranks spawned here; under torchrun, the ranks torchrun started).

On GPUs, one rank per GPU, each on cuda:LOCAL_RANK, in bf16 autocast by default:
  torchrun --nproc-per-node 8 -m moeflow.cli train --preset small --dtype bf16
  moeflow train --device cuda --nproc 2 --preset small      (2 local ranks, 2 GPUs)"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from moeflow.commands.common import (add_device_arg, add_launch_args, parse_overrides,
                                     run_on_ranks)
from moeflow.config import DTYPES, ConfigError, ModelConfig, PRESETS, TrainConfig, model_preset
from moeflow.data import Corpus, skipped_note
from moeflow.launch import under_torchrun
from moeflow.autotune import recorded_choices
from moeflow.trainer import (PREEMPTED_EXIT, PREEMPTED_FILE, FaultConfig, build_config,
                           check_deterministic, check_same_model, latest_checkpoint,
                           train_worker)


# help of each TrainConfig option (a field missing here gets a pointer to TrainConfig)
TRAIN_HELP = {
    "steps": "optimizer steps in all; a resumed run continues up to this step",
    "batch_size": "sequences per rank per micro-batch (a step is --grad-accum of them)",
    "recompute": "activation recomputation: none, full (every block recomputed in backward, "
                 "torch.utils.checkpoint) or moe_act (the MoE layers keep their exchanged "
                 "tokens and recompute their experts' activations)",
    "grad_accum": "micro-batches per optimizer step: gradients are accumulated over them and "
                  "synchronised once (global batch: nproc / mp x batch-size x grad-accum)",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "the cosine decay ends at this fraction of --lr",
    "warmup_steps": "steps of linear learning-rate warm-up (default: min(30, steps // 10))",
    "weight_decay": "AdamW weight decay of the matrices (norms and biases get none)",
    "grad_clip": "clip the global gradient norm to this (0: no clipping)",
    "eval_every": "validate every this many steps (and at the end)",
    "eval_batches": "validation batches per rank",
    "log_every": "write a metrics line every this many steps (and at the end)",
    "checkpoint_every": "also save a checkpoint every this many steps (0: at the end only)",
    "seed": "seed of the batches and the router noise (the weights' seed is --set seed=N)",
    "ep_size": "expert-parallel group size (default: all ranks, divided by --esp); the "
               "experts are replicated over nproc / (ep-size x esp) groups",
    "mp_size": "Parm: tensor-parallel (MP) group size: attention heads and the dense MLP are "
               "split over this many consecutive ranks, which share one batch",
    "dense_shard": "the dense (non-expert) weights: replicate (whole on every rank) or fsdp "
                   "(FSDP2 shards them, their gradients and AdamW state over the data-parallel "
                   "ranks; with --mp, each MP rank's shards over its data-parallel ranks)",
    "pp": "pipeline-parallel stages: the GPT's blocks are cut into this many stages on "
          "groups of nproc / pp ranks (--pp-layout), each stage expert parallel over its own "
          "ranks (docs/training.md, 'Pipeline parallelism'; default 1: none)",
    "pp_layout": "where the pipeline ranks sit: across-nodes (default: a stage is a block of "
                 "consecutive ranks, the pipeline crosses the nodes, EP inside them) or "
                 "within-nodes (a stage is strided over the nodes, each node holds whole "
                 "pipelines, EP across the nodes)",
    "pp_overlap": "auto, on or off: with --pp-schedule dualpipev, run each overlapped forward "
                  "/ backward pair so that one micro-batch's MoE all-to-all is in flight "
                  "while the other computes (DeepSeek-V3 Section 3.2.1; auto: on with "
                  "dualpipev; off: the pair's halves one after the other)",
    "pp_schedule": "the pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, "
                   "interleaved-1f1b, zbv or dualpipev (the last three: 2 stages per rank); "
                   "the --grad-accum micro-batches are the pipeline's",
    "esp_size": "Parm: expert-sharding (ESP) group size: each expert's hidden dimension is "
                "split over this many ranks",
}
ESP_PLACEMENTS = {"esp-in-node": True, "ep-in-node": False}


def register(sub) -> None:
    p = sub.add_parser("train", help="train the MoE GPT", description=__doc__)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="model size (tiny trains on 2 CPU cores in minutes)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=V",
                   help="override a ModelConfig field (--set n_layers=2) or a MoEConfig "
                        "field of every MoE block (--set moe.top_k=1 --set "
                        "moe.capacity_factor=none for dropless); repeatable (default: none)")
    p.add_argument("--data", default=None,
                   help="a text file or folder (default: CPython's embedded documentation)")
    p.add_argument("--out", default=None, help="run folder (default runs/<preset>-<time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--keep-checkpoints", type=int, default=None, metavar="K",
                   help="keep only the newest K published checkpoints (default: keep all)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background (torch.distributed.checkpoint."
                        "async_save) while the next steps run; each is published when its "
                        "write has finished on every rank")
    p.add_argument("--preempt-check-every", type=int, default=1, metavar="K",
                   help="agree on a preemption signal (SIGTERM / SIGUSR1) every K steps: one "
                        "host all-reduce per K steps; a signal is acted on at the next multiple "
                        "of K (default 1: every step)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart every rank up to N times after one fails (torch's elastic "
                        "agent); restarted ranks resume from the latest complete checkpoint, "
                        "redoing at most the steps since it (under torchrun: use torchrun's "
                        "--max-restarts)")
    p.add_argument("--deterministic", action="store_true",
                   help="reproducible run: the auto-tuned exchange settings are fixed (those "
                        "of --tuned-from or the checkpoint when resuming, else a2a=direct, "
                        "schedule=sequential, pipeline_degree=1) and never re-tuned, and torch "
                        "runs its deterministic algorithms; two runs of one command log "
                        "identical losses (docs/training.md, 'Reproducible runs'; default: "
                        "off, the settings are measured)")
    p.add_argument("--tuned-from", dest="tuned_from", default=None, metavar="RUN_DIR",
                   help="start the MoE layers with the tuner choices recorded in RUN_DIR's "
                        "autotune.jsonl (an earlier run on the same layout) instead of "
                        "tuning (default: none)")
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("collective_timeout_s", "device", "dtype", "esp_in_node",
                      "deterministic", "tuned_from"):
            continue
        p.add_argument(TrainConfig.flag(f.name), dest=f.name, default=f.default,
                       type=int if f.default is None else type(f.default),
                       help=TRAIN_HELP.get(f.name, f"TrainConfig.{f.name}"))
    p.add_argument("--esp-placement", default="esp-in-node", choices=sorted(ESP_PLACEMENTS),
                   help="Parm: which groups sit inside a node: the ESP groups (Section IV-A "
                        "case 2) or the EP groups (case 3)")
    add_device_arg(p, default=TrainConfig.device)
    p.add_argument("--dtype", default=TrainConfig.dtype, choices=DTYPES,
                   help="forward precision: bf16 runs forward passes under bf16 autocast "
                        "(weights, gradients and optimizer state stay fp32); auto is bf16 on "
                        "cuda and fp32 on cpu")
    add_launch_args(p, default_nproc=2)
    p.set_defaults(func=run)


# Not placement: it stays "ep" unless --set moe.placement=auto. That choice is measured too,
# but under the default tuning budget node_dedup's screen entry takes time the overlap trials
# would get, so on several nodes it can end slower than tuning "ep" alone (never slower than
# direct, measured first); docs/autotune.md, "Tuning the placement".
TRAIN_AUTO = {"a2a": "auto", "schedule": "auto", "pipeline_degree": "auto"}


def configs_from_args(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig]:
    """The model and train configs that ``moeflow train ARGS`` runs (validated)."""
    # the exchange settings are measured on the cluster (auto-tuning) unless --set fixes them
    # (not with FSSDP or Parm's S1/S2/auto, whose exchanges the tuner does not time)
    from moeflow.registry import registry

    overrides = parse_overrides(args.overrides, ModelConfig)
    moe = overrides.get("moe", {})
    # placement="auto" runs as "ep" until tuned: the fields "ep" lets the tuner time
    placement = moe.get("placement", "ep")
    strategy = registry("strategy").get("ep" if placement == "auto" else placement)
    tunable = (() if strategy is None    # unknown: MoEConfig names the registered ones
               or moe.get("parallel_schedule", "baseline") != "baseline"
               or getattr(args, "pp", 1) > 1    # --pp: fixed settings (layout_checks)
               else strategy.tunable_fields)
    overrides["moe"] = {**{f: v for f, v in TRAIN_AUTO.items() if f in tunable}, **moe}
    mcfg = model_preset(args.preset, **overrides)
    tcfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                          if f.name not in ("collective_timeout_s", "esp_in_node")},
                       collective_timeout_s=args.timeout,
                       esp_in_node=ESP_PLACEMENTS[getattr(args, "esp_placement", "esp-in-node")])
    return mcfg, tcfg


def check_layout(mcfg: ModelConfig, tcfg: TrainConfig, world: int,
                 local: int | None = None) -> None:
    """The expert-parallel (and Parm MP / ESP) layout the ranks will build, checked before
    they start. ``local``: ranks per node (default: all on one node)."""
    build_config(mcfg, tcfg)                 # what --recompute composes with
    check_deterministic(mcfg, tcfg)
    if tcfg.pp > 1:            # the expert-parallel layout below lives inside a pipeline stage
        from moeflow.pipeline_parallel import check_pipeline
        from moeflow.pipeline_parallel.mesh import stage_ranks_per_node

        stage = check_pipeline(mcfg, tcfg, world, local)
        local = stage_ranks_per_node(world, tcfg.pp, local or world, tcfg.pp_layout)
        world = stage
    if tcfg.mp_size > 1 or tcfg.esp_size > 1:
        check_parm_sizes(mcfg, tcfg, world, local or world)
    esp = tcfg.esp_size if world % tcfg.esp_size == 0 else 1
    ep = tcfg.ep_size or world // esp
    if world % ep:
        raise ConfigError(f"--ep-size {ep} is invalid with {world} ranks: it must "
                          f"divide the number of ranks; pick one of "
                          f"{[d for d in range(1, world + 1) if world % d == 0]}")
    experts = mcfg.moe.num_experts
    if mcfg.num_moe_layers and experts % ep:
        raise ConfigError(
            f"--set moe.num_experts={experts} is invalid with an expert-parallel size of "
            f"{ep} (--ep-size; default: all ranks): every rank holds num_experts / ep-size "
            f"experts; use {-(-experts // ep) * ep} experts or --ep-size "
            f"{math.gcd(experts, world)}")


def check_parm_sizes(mcfg: ModelConfig, tcfg: TrainConfig, world: int, local: int) -> None:
    """--mp / --esp against the world, the node size and the model (Parm, docs/parm.md)."""
    from moeflow.experts.structure import expert_hidden
    from moeflow.parallel.tensor_parallel import check_divisible
    from moeflow.topology import check_parm_layout

    mp, esp = tcfg.mp_size, tcfg.esp_size
    for flag, v in (("--mp", mp), ("--esp", esp)):
        if world % v:
            raise ConfigError(f"{flag} {v} is invalid with {world} ranks: it must divide the "
                              f"number of ranks; pick one of "
                              f"{[d for d in range(1, world + 1) if world % d == 0]}")
    ep = tcfg.ep_size or world // esp
    check_parm_layout(world, local, ep, mp, esp, tcfg.esp_in_node)
    check_divisible("ModelConfig", "n_heads", mcfg.n_heads, mp)
    if mcfg.num_moe_layers < mcfg.n_layers:
        check_divisible("ModelConfig", "d_ff", mcfg.d_ff, mp)
    if mcfg.num_moe_layers:
        hidden = expert_hidden(mcfg.moe_config(mcfg.moe_layer_ids()[0]))
        if hidden % esp:
            ok = [d for d in range(1, hidden + 1) if hidden % d == 0 and world % d == 0]
            raise ConfigError(f"--esp {esp} is invalid with an expert hidden width of {hidden} "
                              f"(--set moe.d_expert={mcfg.moe.d_expert}): each expert's hidden "
                              f"dimension is split over the ESP group; pick --esp from {ok}")


def check_data(args: argparse.Namespace, mcfg: ModelConfig, tcfg: TrainConfig) -> None:
    """Load --data as the ranks will (errors here, not in every rank); report skipped files."""
    try:
        corpus = Corpus.load(args.data)
        for split in ("train", "val"):
            corpus.batch(split, 1, mcfg.seq_len, tcfg.seed, 0, 0)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if corpus.skipped and os.environ.get("RANK", "0") == "0":
        print(f"--data {args.data}: {skipped_note(corpus.skipped)}")


def fault_config(args: argparse.Namespace) -> FaultConfig:
    return FaultConfig(keep_checkpoints=getattr(args, "keep_checkpoints", None),
                       max_restarts=getattr(args, "max_restarts", 0),
                       async_checkpoint=getattr(args, "async_checkpoint", False),
                       preempt_check_every=getattr(args, "preempt_check_every", 1))


def restart_lines(restarts: list[dict]) -> str:
    """The summary's account of the elastic agent's restarts ('' when there were none)."""
    if not restarts:
        return ""
    parts = [f"restart {r['restart']} resumed from step {r['resumed_from_step']} and redid "
             f"{r['steps_redone']} step{'s' if r['steps_redone'] != 1 else ''}"
             for r in restarts]
    n = len(restarts)
    return f"ranks restarted {n} time{'s' if n > 1 else ''}: " + "; ".join(parts)


def preempted_exit(rec: dict, out: str) -> int:
    """Report a preemption (a checkpoint was saved at the step the ranks agreed on)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"preempted by {rec['signal']}: checkpoint at step {rec['step']} "
              f"({Path(out) / 'checkpoint' / rec['checkpoint']}); continue with "
              f"moeflow train --resume --out {out} (and the same options)")
    return PREEMPTED_EXIT


def run(args: argparse.Namespace) -> int:
    mcfg, tcfg = configs_from_args(args)
    fault = fault_config(args)
    if args.resume and args.out is None:
        raise SystemExit("moeflow train: --resume needs --out (the run folder to continue)")
    out = args.out or str(Path("runs") / f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    # Everything that can fail before training is checked here, once, not in every rank.
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun() else world
    if world >= 1:
        check_layout(mcfg, tcfg, world, local)
    check_data(args, mcfg, tcfg)
    if tcfg.tuned_from is not None:
        recorded_choices(tcfg.tuned_from)    # readable records, checked before the ranks start
    first = 0                                    # the step this invocation starts from
    if args.resume:
        if (Path(out) / "config.json").exists():
            check_same_model(out, mcfg)
        _, step = latest_checkpoint(out)
        first = step
        if step >= tcfg.steps:
            if os.environ.get("RANK", "0") == "0":
                print(f"nothing to do: the checkpoint in {out} is at step {step} and --steps is "
                      f"{tcfg.steps}; to train further, resume with a larger --steps (e.g. "
                      f"--steps {2 * step})")
            return 0
    start = time.perf_counter()
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        result = run_on_ranks(train_worker, args, mcfg, tcfg, out, args.data, args.resume,
                              not args.no_progress, fault, log_dir=out,
                              max_restarts=fault.max_restarts)
    except SignalException as err:
        # the agent got the signal, passed it to the ranks and waited (30 s) for them to stop
        if (Path(out) / PREEMPTED_FILE).exists():
            return preempted_exit(json.loads((Path(out) / PREEMPTED_FILE).read_text()), out)
        print(f"moeflow train: stopped by {err.sigval.name} before a checkpoint was saved; "
              f"resume from the latest one with --resume --out {out}", file=sys.stderr)
        return 128 + int(err.sigval)
    if result is not None and result.get("preempted"):
        return preempted_exit(result["preempted"], out)
    if result is None and under_torchrun() and (Path(out) / PREEMPTED_FILE).exists():
        return PREEMPTED_EXIT              # torchrun's other ranks: rank 0's exit status
    if result is not None:
        vals = [(r["step"], r["val_loss"]) for r in result["history"] if "val_loss" in r]
        resumed = (f" (resumed from step {first}, now at step {result['step']})"
                   if first else "")
        print(f"done: {result['step'] - first} steps in "
              f"{time.perf_counter() - start:.0f}s{resumed}, "
              f"validation loss {result['final_val_loss']:.3f} nats/byte")
        if result.get("restarts"):
            print(restart_lines(result["restarts"]))
        print("validation curve (step: nats/byte): "
              + ", ".join(f"{s}: {v:.3f}" for s, v in vals))
        print(f"metrics: {Path(out) / 'metrics.jsonl'}  checkpoint: "
              f"{Path(out) / 'checkpoint'}")
        print(json.dumps({"final_val_loss": result["final_val_loss"],
                          "final_loss": result.get("final_loss"), "steps": result["step"],
                          "restarts": result.get("restarts", [])}))
    return 0
