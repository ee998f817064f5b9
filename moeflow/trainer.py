"""The training loop of ``moeflow train``: a byte-level MoE GPT with expert parallelism.

Runs on every rank (torch.distributed initialised, or a world of one). AdamW with linear
warm-up and cosine decay, global-norm gradient clipping that counts each expert once, periodic
validation, metrics as JSON lines (the loss with the global gradient norm before clipping, as
torchtitan and Megatron-core log it), a progress bar on rank 0, and DCP checkpoints that resume
exactly (the batch of step s depends only on (seed, s, data-parallel rank)). The auto-tuner
prints one line per tuning; its detail and a record per tuning go to the run folder
(``autotune.log``, ``autotune.jsonl``: :mod:`moeflow.autotune.runlog`).

Parm (``--mp`` / ``--esp``, docs/parm.md): the GPT's dense layers are tensor parallel over MP
groups of consecutive ranks, which share one batch (drawn for the data-parallel rank
``rank // mp_size``), and the experts are sharded over ESP groups.

Devices: ``TrainConfig.device`` (``--device``) puts the model and the batches on
``cuda:LOCAL_RANK`` or the CPU; ``TrainConfig.dtype`` (``--dtype``) runs forward passes under
bf16 autocast (the default on CUDA) or in fp32 (the default on CPU). Checkpoints load in place
into the live tensors, so a run saved on one device type resumes on the other.

Failures (docs/training.md, "Failures"): checkpoints are published atomically
(:mod:`moeflow.checkpoint`), optionally written in the background (``dcp.async_save``) and
pruned to the newest K; ranks restarted by torch's elastic agent resume from the latest
complete checkpoint by themselves; SIGTERM / SIGUSR1 make every rank stop after the same step
with a checkpoint there (exit status ``PREEMPTED_EXIT``).

Reproducible runs (``TrainConfig.deterministic``, ``--deterministic``; docs/training.md): the
auto-tuned layers start with fixed choices (``TrainConfig.tuned_from``'s recorded ones, the
checkpoint's, or the untuned defaults) and never re-tune, and torch runs its deterministic
algorithms, so two runs of one command log identical losses.

Gradient accumulation (``TrainConfig.grad_accum``, ``--grad-accum N``): a step runs N
micro-batches of ``batch_size`` sequences, adds their gradients and synchronises, clips and
steps once; the router biases (DeepSeek-V3) are updated once per step with the loads of all N.
FSDP2 (``TrainConfig.dense_shard="fsdp"``, ``--dense-shard fsdp``, :mod:`moeflow.parallel.fsdp`):
the dense part's parameters, gradients and AdamW state are sharded over the data-parallel
ranks; the experts keep their layout. The GPT is built sharded from the start
(:mod:`moeflow.models.fsdp_build`): no rank holds the whole dense part, at start-up either.
Activation recomputation (``TrainConfig.recompute``, ``--recompute full|moe_act``): every block
under non-reentrant ``torch.utils.checkpoint``, or only the MoE experts' activations.

Pipeline parallelism (``TrainConfig.pp``, ``--pp N --pp-schedule S``,
:mod:`moeflow.pipeline_parallel`):
the GPT's blocks in stages on consecutive blocks of ``world / pp`` ranks, each stage expert
parallel over its own ranks; the ``grad_accum`` micro-batches go through torch's pipeline
schedule, and the data-parallel rank (the batch drawn) is the rank's position in its stage.

Host synchronisation: a training step leaves its loss, auxiliary loss and balance loss on the
device as tensors and clips gradients with tensor ops, so no step waits for the device except
at logging intervals, where the accumulated statistics are averaged over ranks in one
all-reduce and read once.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moeflow import checkpoint
from moeflow.autotune import TunedChoice, append_record, layout, log_to_run_folder, \
    placeholder, recorded_choices
from moeflow.autotune import log as autotune_log
from moeflow.strategies import model_hooks
from moeflow.config import ConfigError, ModelConfig, TrainConfig, config_differences
from moeflow.data import Corpus
from moeflow.devices import autocast, host_all_reduce, resolve_device, resolve_dtype
from moeflow.launch import restart_count
from moeflow.models import GPT
from moeflow.models.fsdp_build import build_fsdp_gpt
from moeflow.parallel.grad_clip import clip_gradients
from moeflow.parallel.fsdp import set_gradient_sync
from moeflow.parallel.grad_sync import sync_gradients
from moeflow.parallel.replicas import prepare_model
from moeflow.pipeline_parallel import PipelineRunner, stage_dp_rank
from moeflow.routing import update_router_biases
from moeflow.topology import Topology


# Preemption (docs/training.md, "Failures"): on one of these signals every rank finishes its
# step, the ranks agree on the step, save a checkpoint there and the command exits with
# PREEMPTED_EXIT (75, EX_TEMPFAIL of sysexits.h: "try again later"; 143 would be SIGTERM's
# default death and 1 a failure). PREEMPTED_FILE in the run folder names the step.
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT = 75
PREEMPTED_FILE = "preempted.json"
SAVES_FILE = "checkpoints.jsonl"   # one record per save: step, async, stall_s


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms or biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), foreach=False)


def _world_mean(values: torch.Tensor, topo: Topology) -> list[float]:
    """The mean over ranks of a 1-D tensor of statistics: one all-reduce (on the tensor's
    device) and one device-to-host read."""
    t = values.detach().to(torch.float64)
    if topo.distributed:
        dist.all_reduce(t)
        t /= topo.world_size
    return t.tolist()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on ``device``; on CUDA copied from pinned memory without blocking."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def evaluate(model: GPT, corpus: Corpus, cfg: TrainConfig, topo: Topology,
             device: torch.device = torch.device("cpu"),
             dtype: torch.dtype = torch.float32) -> float:
    """Mean validation cross-entropy (nats/byte) over ``eval_batches`` batches per rank."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(cfg.eval_batches):
        x, y = corpus.batch("val", cfg.batch_size, model.cfg.seq_len, cfg.seed, i,
                            topo.dp_rank)
        with autocast(device, dtype):
            total += model(_to_device(x, device), _to_device(y, device))[1].double()
    model.train()
    return _world_mean((total / cfg.eval_batches).reshape(1), topo)[0]


def build_config(model_cfg: ModelConfig, train_cfg: TrainConfig) -> ModelConfig:
    """The model config the ranks build: ``recompute="moe_act"`` sets
    ``MoEConfig.recompute`` in every MoE block (the run's ``config.json`` keeps the model
    config as given: recomputation changes memory and time, not the function)."""
    if train_cfg.recompute == "full":
        model_hooks.refuse_block_recompute(
            ((i, model_cfg.moe_config(i)) for i in range(model_cfg.n_layers)
             if model_cfg.is_moe(i)), "--recompute: TrainConfig.recompute='full'")
    if train_cfg.recompute != "moe_act":
        return model_cfg
    return model_cfg.replace(moe={"recompute": "moe_act"})


def micro_batches(corpus: Corpus, cfg: TrainConfig, seq_len: int, step: int,
                  dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``grad_accum`` micro-batches of optimizer step ``step`` on data-parallel rank
    ``dp_rank``: the step's ``grad_accum * batch_size`` sequences (drawn as one batch, so
    ``--batch-size B --grad-accum N`` sees exactly the sequences of ``--batch-size N*B``), cut
    into ``grad_accum`` consecutive parts of ``batch_size``."""
    x, y = corpus.batch("train", cfg.batch_size * cfg.grad_accum, seq_len, cfg.seed, step,
                        dp_rank)
    return list(zip(x.split(cfg.batch_size), y.split(cfg.batch_size)))


def accumulate_gradients(model: GPT, micro: list[tuple[torch.Tensor, torch.Tensor]],
                         device: torch.device = torch.device("cpu"),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Forward and backward every micro-batch, adding ``(ce_i + aux_i) / N`` gradients into
    ``.grad`` (no collective of its own: the caller synchronises once, after the last
    micro-batch; FSDP2's reduce-scatter runs in the last micro-batch's backward only). With
    equal micro-batches the cross-entropy part is the gradient of the mean over all ``N``
    micro-batches' tokens, i.e. of the N-times batch; the MoE layers' capacity and balancing
    loss are those of each micro-batch (docs/training.md, "Gradient accumulation"). Returns ``[ce, aux_loss, balance_loss]``, means over the micro-batches,
    as a float64 tensor on ``device`` (not read: no host synchronisation)."""
    n = len(micro)
    out = torch.zeros(3, dtype=torch.float64, device=device)
    for i, (x, y) in enumerate(micro):
        set_gradient_sync(model, i == n - 1)     # FSDP2: reduce-scatter once, at the last
        with autocast(device, dtype):
            _, ce = model(_to_device(x, device), _to_device(y, device))
            aux = model.aux_loss
        ((ce + aux) / n).backward()
        balance = [torch.as_tensor(m.stat_tensors["balance_loss"], device=device).double()
                   for m in model.moe_layers()]
        out += torch.stack([ce.detach().double(), aux.detach().double().to(device),
                            torch.stack(balance).sum() if balance
                            else torch.zeros((), dtype=torch.float64, device=device)])
    return out / n


def latest_checkpoint(out_dir: str | Path) -> tuple[Path, int]:
    """The latest complete checkpoint of a run folder and its step (``FileNotFoundError`` if
    none). One cut short by a crash is skipped with a warning (:func:`checkpoint.find_latest`)."""
    root = Path(out_dir) / "checkpoint"
    found = checkpoint.find_latest(root)
    if found is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {root} (expected a complete "
                                "step-N folder and a 'latest' file written by an earlier run "
                                "with this --out)")
    return found


def check_same_model(out_dir: str | Path, model_cfg: ModelConfig) -> None:
    """Raise ``ConfigError`` if the run folder's config.json holds another model config."""
    path = Path(out_dir) / "config.json"
    # fields added after the run was saved count as their defaults
    saved = ModelConfig.from_dict(json.loads(path.read_text())["model"], f"--resume: {path}")
    if saved != model_cfg:
        diff = config_differences(saved, model_cfg)
        raise ConfigError(f"--resume: the model config differs from the checkpoint's "
                          f"(field: (saved, now)) {diff}; resume with the same model options")


def check_deterministic(model_cfg: ModelConfig, train_cfg: TrainConfig) -> None:
    """``--deterministic`` refuses what chooses by timing and cannot be fixed from a record:
    Parm's ``parallel_schedule="auto"`` (Algorithm 1 on measured fits)."""
    if not train_cfg.deterministic:
        return
    auto = [i for i in model_cfg.moe_layer_ids()
            if model_cfg.moe_config(i).parallel_schedule == "auto"]
    if auto:
        raise ConfigError(f"--deterministic: MoEConfig.parallel_schedule='auto' (MoE blocks "
                          f"{auto}) picks Parm's schedule from timings measured on the "
                          "machine; fix it with --set moe.parallel_schedule=s1 (or s2, baseline)")


def use_deterministic_algorithms(seed: int) -> None:
    """``--deterministic``'s torch settings: deterministic kernels (an op without one raises),
    no cuDNN benchmarking, cuBLAS's fixed workspace (torch's documented requirement for
    deterministic cuBLAS on CUDA >= 10.2) and the Python RNG seeded. Process-wide."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    random.seed(seed)


def untuned_choice(layer) -> TunedChoice:
    """The fixed settings ``--deterministic`` gives an auto-tuned layer without a recorded
    choice: the tuner's placeholder (a2a ``direct``, schedule ``sequential``,
    pipeline_degree 1, codec ``none``), not measured."""
    cfg = placeholder(layer.requested_cfg)
    return TunedChoice(cfg.a2a, cfg.schedule, cfg.pipeline_degree, None, None,
                       layout(layer.topo), codec=cfg.codec,
                       lossy_error_budget=layer.requested_cfg.effective_lossy_error_budget)


@dataclasses.dataclass
class FaultConfig:
    """How ``moeflow train`` survives failures (docs/training.md, "Failures").

    keep_checkpoints: keep the newest K published checkpoints (None: all).
    max_restarts: restarts of all ranks that torch's elastic agent makes after a rank fails;
    each restarted rank resumes from the latest complete checkpoint.
    async_checkpoint: write checkpoints with ``dcp.async_save`` (published when the write has
    finished on every rank: before the next save starts, and at the end).
    preempt_check_every: the ranks agree on a preemption signal every K steps (a host
    all-reduce: on gloo a barrier of the hosts, on an NCCL-only default group a device
    synchronisation); a signal is acted on at the next multiple of K, so up to K - 1 more
    steps run before the checkpoint (K = 1: after every step).
    """

    keep_checkpoints: int | None = None
    max_restarts: int = 0
    async_checkpoint: bool = False     # dcp.async_save: the write overlaps the next steps
    preempt_check_every: int = 1       # agree on a preemption signal every K steps

    def __post_init__(self) -> None:
        k = self.keep_checkpoints
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"--keep-checkpoints: FaultConfig.keep_checkpoints={k!r} is "
                              "invalid: keep at least 1 checkpoint (leave it unset to keep all)")
        r = self.max_restarts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"--max-restarts: FaultConfig.max_restarts={r!r} is invalid: "
                              "must be an integer >= 0 (0: a failed rank ends the run)")
        k = self.preempt_check_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"--preempt-check-every: FaultConfig.preempt_check_every={k!r} is "
                              "invalid: must be an integer >= 1 (steps between the ranks' "
                              "agreements on a preemption signal; 1: every step)")


def fixed_shape_batches(model_cfg: ModelConfig) -> ModelConfig:
    """The model's config as the trainer builds it: every rank's training and validation
    batches are (batch_size, seq_len), so every MoE layer may declare
    ``MoEConfig.equal_rank_tokens`` (its capacity and Parm-auto host collectives then run
    once per distinct token count, not on every call), unless ``moe`` sets it already. The
    run's saved config stays the user's."""
    if model_cfg.moe.equal_rank_tokens is not None:      # the user's declaration
        return model_cfg
    return model_cfg.replace(moe={"equal_rank_tokens": True})


class Trainer:
    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, out_dir: str | Path,
                 topo: Topology, data: str | None = None, progress: bool = True,
                 fault: FaultConfig | None = None):
        self.mcfg, self.cfg, self.topo = model_cfg, train_cfg, topo
        self.ft = fault or FaultConfig()
        self.out = Path(out_dir)
        self.progress = progress and topo.rank == 0
        self.corpus = Corpus.load(data)
        check_deterministic(model_cfg, train_cfg)
        # the data-parallel position (the batch drawn); with --pp, the rank's place in its stage
        self.dp_rank, self.dp_size = topo.dp_rank, topo.dp_size
        if train_cfg.pp > 1:
            self.dp_rank = stage_dp_rank(topo.rank, topo.world_size, train_cfg.pp,
                                         train_cfg.pp_layout)
            self.dp_size = topo.world_size // train_cfg.pp
        if train_cfg.deterministic:
            use_deterministic_algorithms(train_cfg.seed + self.dp_rank)
        self.device = resolve_device(train_cfg.device, "TrainConfig.device")
        self.dtype = resolve_dtype(train_cfg.dtype, self.device, "TrainConfig.dtype")
        gpt_cfg = fixed_shape_batches(build_config(model_cfg, train_cfg))
        self.pipeline = None
        if train_cfg.pp > 1:      # this rank's stages, initialised from (seed, name) as the GPT
            self.pipeline = PipelineRunner(gpt_cfg, train_cfg, self.device, self.dtype)
            self.model = self.pipeline.model
        elif train_cfg.dense_shard == "fsdp":
            # FSDP2 on the dense part (parallel.fsdp), sharded from the start: no rank ever
            # holds the whole dense part (models.fsdp_build)
            self.model = build_fsdp_gpt(gpt_cfg, topo, self.device, compute_dtype=self.dtype)
        else:      # replicas start equal (broadcast from rank 0 of each replica group)
            self.model = prepare_model(GPT(gpt_cfg, topo).to(self.device), topo)
        self.model.checkpoint_blocks = train_cfg.recompute == "full"
        self.opt = make_optimizer(self.model, train_cfg)
        self.step = 0
        self.start_step = 0           # the step this run started from (resumed: the checkpoint's)
        self.elapsed_before = 0.0     # training seconds before start_step (from the checkpoint)
        self.start_time = time.perf_counter()    # of the training clock (elapsed_s)
        self.history: list[dict] = []
        self.grad_norm = torch.zeros(())   # the last step's global gradient norm before clipping
        self._signal = 0              # the preemption signal received (0: none)
        self._pending = None          # (future, staged folder, step, elapsed) of an async save
        # async saves run their collectives on a gloo group of their own (from a thread)
        self._ckpt_group = (dist.new_group(backend="gloo",
                                           timeout=datetime.timedelta(
                                               seconds=train_cfg.collective_timeout_s))
                            if fault is not None and fault.async_checkpoint and topo.distributed
                            else None)
        # under an agent that restarts ranks, rank 0 records the step reached (a tiny file)
        self._track_reached = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0

    # ---- bookkeeping ----------------------------------------------------------------------
    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoint"

    def _log(self, record: dict) -> None:
        self.history.append(record)
        if self.topo.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def _write_config(self) -> None:
        if self.topo.rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(
            {"model": dataclasses.asdict(self.mcfg), "train": dataclasses.asdict(self.cfg),
             "world_size": self.topo.world_size,
             "local_size": self.topo.local_size,     # ranks per node (simulate --measured)
             **({"resumed_from_step": self.start_step} if self.start_step else {})}, indent=2))

    def save(self) -> None:
        """Write this step's checkpoint under a temporary name, then publish it (rename, then
        ``latest`` replaced atomically) once every rank's part is on disk. With
        ``async_checkpoint`` the write continues in the background; the previous one is
        finished and published first. Logs the time the training stood still for it."""
        t0 = time.perf_counter()
        self.finish_pending_save()
        staged = checkpoint.staging_path(self.ckpt_root, self.step)
        if self.topo.rank == 0 and staged.exists():      # left by a run that crashed here
            shutil.rmtree(staged)
        self._barrier()
        elapsed = time.perf_counter() - self.start_time
        if self.ft.async_checkpoint:
            future = checkpoint.async_save(str(staged), self.model, self.opt, self.step,
                                           self._ckpt_group)
            self._pending = (future, staged, self.step, elapsed)
        else:
            checkpoint.save(str(staged), self.model, self.opt, self.step)
            self._publish_when_complete(staged, self.step, elapsed)
        if self.topo.rank == 0:
            with open(self.out / SAVES_FILE, "a") as f:
                f.write(json.dumps({"event": "checkpoint", "step": self.step,
                                    "async": self.ft.async_checkpoint,
                                    "stall_s": time.perf_counter() - t0}) + "\n")

    def finish_pending_save(self) -> None:
        """Wait for the background checkpoint write (if any) and publish it."""
        if self._pending is None:
            return
        future, staged, step, elapsed = self._pending
        self._pending = None
        future.result()
        self._publish_when_complete(staged, step, elapsed)

    def _publish_when_complete(self, staged: Path, step: int, elapsed: float) -> None:
        self._barrier()                                  # every rank's part is on disk
        if self.topo.rank == 0:
            (staged / "progress.json").write_text(json.dumps(
                {"step": step, "elapsed_s": elapsed}))
            self._publish(staged, step)
        self._barrier()

    def _publish(self, staged: Path, step: int) -> None:
        """Rank 0: publish the complete folder ``staged`` and apply the retention."""
        checkpoint.publish(staged, self.ckpt_root, step)
        if self.ft.keep_checkpoints is not None:
            checkpoint.prune(self.ckpt_root, self.ft.keep_checkpoints)

    REACHED = ".reached"          # rank 0: the last finished step (for restarts' steps redone)

    def _mark_reached(self) -> None:
        """Under an elastic agent that may restart the ranks: record the step reached, so a
        restart can report the steps it redoes."""
        if self.topo.rank == 0 and self._track_reached:
            tmp = self.out / f".reached.tmp-{os.getpid()}"
            tmp.write_text(str(self.step))
            os.replace(tmp, self.out / self.REACHED)

    def _log_restart(self, restart: int) -> dict:
        """The restart record (in metrics.jsonl on rank 0): the attempt number, the step
        resumed from and the steps of the failed attempt that are redone."""
        reached_file = self.out / self.REACHED
        reached = int(reached_file.read_text()) if reached_file.exists() else self.start_step
        rec = {"event": "restart", "restart": restart,
               "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
               "resumed_from_step": self.start_step,
               "steps_redone": max(0, reached - self.start_step)}
        if self.topo.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    def restarts(self) -> list[dict]:
        """The restart records of this launch (this elastic run id) in metrics.jsonl."""
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        path = self.out / "metrics.jsonl"
        if run_id is None or not path.exists():
            return []
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in recs if r.get("event") == "restart" and r.get("run_id") == run_id]

    # ---- preemption ------------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        self._signal = signum

    def _install_handlers(self) -> dict:
        """SIGTERM / SIGUSR1 set a flag (checked after each step); returns the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._on_signal) for s in PREEMPT_SIGNALS}

    def _agreed_signal(self) -> int:
        """The preemption signal if any rank got one before the end of this step: a
        max-all-reduce of one number (bounded by the process group's timeout), so that every
        rank stops after the same step; only every ``preempt_check_every`` steps (0 between:
        every rank skips the same steps)."""
        if self.step % self.ft.preempt_check_every:
            return 0
        if not self.topo.distributed:
            return self._signal
        return int(host_all_reduce([float(self._signal)], "max")[0])

    def _preempt(self, signum: int) -> dict:
        """Record the preemption after the checkpoint of this step was published."""
        rec = {"event": "preempted", "step": self.step,
               "signal": signal.Signals(signum).name,
               "checkpoint": f"step-{self.step}"}
        if self.topo.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            (self.out / PREEMPTED_FILE).write_text(json.dumps(rec))
        self._barrier()                      # every rank's command sees the file after this
        return rec

    def _barrier(self) -> None:
        if self.topo.distributed:
            dist.barrier()

    def resume(self) -> None:
        path, _ = latest_checkpoint(self.out)
        check_same_model(self.out, self.mcfg)
        self.step = self.start_step = checkpoint.load(str(path), self.model, self.opt)
        progress = path / "progress.json"            # absent in checkpoints of older versions
        if progress.exists():
            self.elapsed_before = json.loads(progress.read_text())["elapsed_s"]

    def fix_tuned_choices(self) -> list[dict]:
        """At the start of a run (after a resume restored the checkpoint's choices): every
        auto-tuned MoE layer starts with the ``tuned_from`` run folder's choice, else the
        checkpoint's, else (``deterministic``) :func:`untuned_choice`; else it tunes at its
        first forward. ``deterministic`` also stops re-tuning. Each choice is appended to this
        run's ``autotune.jsonl`` with its source; returns those records."""
        cfg = self.cfg
        recorded = recorded_choices(cfg.tuned_from) if cfg.tuned_from else {}
        if cfg.tuned_from and not any(m.auto_fields for m in self.model.moe_layers()):
            raise ConfigError(f"--tuned-from {cfg.tuned_from}: no MoE layer of this run is "
                              "auto-tuned (--set fixes a2a, schedule and pipeline_degree, or "
                              "the placement is not tuned), so there is nothing to restore; "
                              "drop --tuned-from or leave those fields 'auto'")
        records = []
        for m in self.model.moe_layers():
            if not m.auto_fields:
                continue
            lid = m.requested_cfg.layer_id
            if cfg.tuned_from:
                if lid not in recorded:
                    raise ConfigError(f"--tuned-from {cfg.tuned_from}: no choice recorded for "
                                      f"the MoE layer with layer_id {lid} (recorded: "
                                      f"{sorted(recorded)}); give a run of the same model")
                choice, source = recorded[lid], f"--tuned-from {cfg.tuned_from}"
                if choice.topology != layout(m.topo):
                    raise ConfigError(f"--tuned-from {cfg.tuned_from}: layer_id {lid} was tuned "
                                      f"on {choice.topology}, this run is "
                                      f"{layout(m.topo)}; give a run on the same layout "
                                      "(ranks, nodes, --ep-size)")
            elif m.tuned is not None:
                choice, source = m.tuned, "checkpoint"
            elif cfg.deterministic:
                choice, source = untuned_choice(m), "fixed defaults"
            else:
                continue
            m.set_tuned(choice)
            if cfg.deterministic:
                m.retune_check_every = None          # no timing-based choice later either
            rec = {"layer_id": lid, "source": source, **choice.settings(),
                   "codec": choice.codec}
            records.append(rec)
            if self.topo.rank == 0:
                self.out.mkdir(parents=True, exist_ok=True)
                append_record(self.out, lid, choice, source)
                autotune_log.info(f"autotune layer_id {lid}: {source}: codec={choice.codec} "
                                  f"a2a={choice.a2a} schedule={choice.schedule} "
                                  f"r={choice.pipeline_degree}, not tuned")
        return records

    # ---- the loop -------------------------------------------------------------------------
    def _evaluate(self) -> float:
        if self.pipeline is None:
            return evaluate(self.model, self.corpus, self.cfg, self.topo, self.device,
                            self.dtype)
        batches = [self.corpus.batch("val", self.cfg.batch_size, self.mcfg.seq_len,
                                     self.cfg.seed, i, self.dp_rank)
                   for i in range(self.cfg.eval_batches)]
        total = self.pipeline.evaluate_batches(batches)
        return _world_mean((total / self.cfg.eval_batches).reshape(1), self.topo)[0]

    def train_step(self) -> torch.Tensor:
        """One optimisation step over ``grad_accum`` micro-batches; returns ``[loss, aux_loss,
        balance_loss]`` (means over the micro-batches) as a float64 tensor on the device
        (reading it is the caller's choice: it waits for the device)."""
        cfg, topo = self.cfg, self.topo
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, cfg)
        micro = micro_batches(self.corpus, cfg, self.mcfg.seq_len, self.step, self.dp_rank)
        self.opt.zero_grad(set_to_none=True)
        if self.pipeline is not None:              # the schedule runs every micro-batch
            stats = self.pipeline.forward_backward(torch.cat([x for x, _ in micro]),
                                                   torch.cat([y for _, y in micro]))
            self.grad_norm = self.pipeline.sync_and_clip(cfg.grad_clip)
            self.opt.step()
            update_router_biases(self.model, self.pipeline.mesh.stage)
        else:
            stats = accumulate_gradients(self.model, micro, self.device, self.dtype)
            sync_gradients(self.model, topo)           # once per optimizer step
            # the global norm before clipping (every rank's, each expert once), logged with
            # the loss
            self.grad_norm = clip_gradients(self.model, topo, cfg.grad_clip)
            self.opt.step()
            update_router_biases(self.model, topo)     # DeepSeek-V3's aux-loss-free balancing
        self.step += 1
        # the strategies' step-end work (FSSDP: re-sharding, re-placement)
        model_hooks.on_step_end(self.model, self.opt, self.step)
        return stats

    def run(self, resume: bool = False, restart: int = 0) -> dict:
        """Train up to ``cfg.steps``. ``resume``: from the latest complete checkpoint.
        ``restart``: this is the elastic agent's restart number ``restart`` of the ranks
        (logged with the step resumed from and the steps redone)."""
        cfg, topo = self.cfg, self.topo
        if resume:
            self.resume()
            if topo.distributed:                     # every rank has read config.json
                dist.barrier()
        if restart:
            self._log_restart(restart)
        if topo.rank == 0 and (self.out / PREEMPTED_FILE).exists():
            (self.out / PREEMPTED_FILE).unlink()         # of an earlier, resumed invocation
        old_handlers = self._install_handlers()
        try:
            with log_to_run_folder(self.out, topo.rank == 0):  # the tuner's detail + records
                if cfg.deterministic or cfg.tuned_from or resume:
                    self.fix_tuned_choices()
                return self._loop(resume, restart)
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)

    def _loop(self, resume: bool, restart: int) -> dict:
        cfg, topo = self.cfg, self.topo
        preempted, signum = None, 0
        if not resume or self.step < cfg.steps:      # record this run's options (new --steps)
            self._write_config()
        if topo.distributed:
            dist.barrier()
        tokens_per_step = (self.dp_size * cfg.batch_size * cfg.grad_accum
                           * self.mcfg.seq_len)
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step",
                       dynamic_ncols=True, mininterval=1.0)
        if self.step == 0:
            self._log({"step": 0, "val_loss": self._evaluate()})
        zeros = torch.zeros(3, dtype=torch.float64, device=self.device)
        t_last, steps_last, sums = time.perf_counter(), 0, zeros.clone()
        self.start_time = start_time = time.perf_counter() - self.elapsed_before
        while self.step < cfg.steps:
            sums += self.train_step()               # stays on the device between log points
            steps_last += 1
            self._mark_reached()
            done = self.step == cfg.steps
            signum = 0 if done else self._agreed_signal()   # every rank stops after this step
            if self.step % cfg.log_every == 0 or done or signum:
                # the gradient norm is global already (the same on every rank): its world
                # mean is itself, read in the same device-to-host copy as the losses
                loss, aux_mean, balance, grad_norm = _world_mean(torch.cat(
                    [sums / steps_last, self.grad_norm.reshape(1).to(sums)]), topo)
                now = time.perf_counter()
                rec = {"step": self.step, "loss": loss, "aux_loss": aux_mean,
                       "balance_loss": balance, "grad_norm": grad_norm,
                       "lr": lr_at(self.step - 1, cfg),
                       "tokens_per_s": tokens_per_step * steps_last / (now - t_last),
                       "elapsed_s": now - start_time}
                rec.update(model_hooks.metrics(self.model))   # the strategies' (last step's)
                if self.step % cfg.eval_every == 0 or done:
                    rec["val_loss"] = self._evaluate()
                self._log(rec)
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.3f}", gnorm=f"{rec['grad_norm']:.3f}",
                                    aux=f"{aux_mean:.4f}",
                                    tok_s=f"{rec['tokens_per_s']:.0f}",
                                    **({"val": f"{rec['val_loss']:.3f}"} if "val_loss" in rec
                                       else {}))
                t_last, steps_last, sums = time.perf_counter(), 0, zeros.clone()
            if bar is not None:
                bar.update(1)
            if done or (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) \
                    or signum:
                self.save()
            if signum:
                break
        self.finish_pending_save()
        if signum:
            preempted = self._preempt(signum)
        if bar is not None:
            bar.close()
        vals = [r["val_loss"] for r in self.history if "val_loss" in r]
        losses = [r["loss"] for r in self.history if "loss" in r]
        return {"step": self.step, "start_step": self.start_step,
                "final_val_loss": vals[-1] if vals else None,
                "final_loss": losses[-1] if losses else None,
                "restarts": self.restarts() if restart else [],
                "preempted": preempted,
                "history": self.history, "out_dir": str(self.out)}


def train_worker(model_cfg: ModelConfig, train_cfg: TrainConfig, out_dir: str,
                 data: str | None, resume: bool, progress: bool = True,
                 fault: FaultConfig | None = None) -> dict:
    """Entry point on every rank (torch.distributed already initialised, or a world of one).

    A rank restarted by torch's elastic agent (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes by
    itself from the latest complete checkpoint in ``out_dir`` (from the start if none was
    published yet)."""
    if train_cfg.pp > 1:        # the world's groups (the stages' own: pipeline_parallel.mesh)
        topo = Topology.from_env()
        dp_rank = stage_dp_rank(topo.rank, topo.world_size, train_cfg.pp,
                                train_cfg.pp_layout)
    else:
        topo = Topology.from_env(ep_size=train_cfg.ep_size, mp_size=train_cfg.mp_size,
                                 esp_size=train_cfg.esp_size, esp_in_node=train_cfg.esp_in_node)
        dp_rank = topo.dp_rank
    # only gate noise / dropout draw from it; the ranks of an MP group draw the same numbers,
    # so the replicated activations of the tensor-parallel GPT get the same dropout mask
    torch.manual_seed(train_cfg.seed + dp_rank)
    if progress and topo.rank == 0:
        from moeflow.autotune import log_to_stderr
        log_to_stderr()                                 # the auto-tuner's progress lines
    restart = restart_count()
    if restart and not resume:
        resume = checkpoint.find_latest(Path(out_dir) / "checkpoint") is not None
    return Trainer(model_cfg, train_cfg, out_dir, topo, data, progress,
                   fault).run(resume, restart)
