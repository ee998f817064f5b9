"""``TrainConfig``: optimisation, bookkeeping and the parallel layout of ``moeflow train``
(Parm Section IV-A's MP / ESP groups, FSDP2 of the dense part, pipeline parallelism), each
error naming the ``moeflow train`` option first."""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.config.validation import config_error
from moeflow.devices import DEVICES, DTYPES
from moeflow.errors import ConfigError

TRAIN_RECOMPUTES = ("none", "full", "moe_act")   # TrainConfig.recompute
DENSE_SHARDS = ("replicate", "fsdp")              # TrainConfig.dense_shard
# TrainConfig.pp_schedule: torch.distributed.pipelining's schedules
# (moeflow.pipeline_parallel.pipeline_schedules)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev")
# TrainConfig.pp_layout: where the pipeline ranks sit on the nodes
# (moeflow.pipeline_parallel.mesh): stages across the nodes (EP inside a node), or inside one
PP_LAYOUTS = ("across-nodes", "within-nodes")
# TrainConfig.pp_overlap: DualPipe's overlapped forward / backward pairs
# (moeflow.pipeline_parallel.overlap_fb); auto: on with dualpipev, the schedule that has them
PP_OVERLAPS = ("auto", "on", "off")


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping for ``moeflow train``.

    ``warmup_steps=None`` (the default) means ``min(30, steps // 10)``: 30 for the default 1000
    steps, none for a 5-step smoke run. Each error names the ``moeflow train`` option first
    (``--warmup-steps: TrainConfig.warmup_steps=50 is invalid: ...``).
    """

    steps: int = 1000
    batch_size: int = 16          # sequences per rank per micro-batch
    grad_accum: int = 1           # micro-batches per optimizer step (gradient accumulation)
    # activation recomputation (docs/training.md): "full" runs every block under
    # torch.utils.checkpoint (non-reentrant), "moe_act" sets MoEConfig.recompute="moe_act"
    recompute: str = "none"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None   # None = min(30, steps // 10)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 0     # 0 = only at the end
    seed: int = 0
    collective_timeout_s: float = 300.0
    ep_size: int | None = None    # None = all ranks (pure expert parallelism)
    device: str = "auto"          # see DEVICES; on cuda rank i of a node uses cuda:LOCAL_RANK
    dtype: str = "auto"           # see DTYPES; bf16 = bf16 autocast (weights stay fp32)
    # Parm (Section IV-A): tensor parallelism of the dense layers over mp_size ranks, each expert
    # sharded over esp_size ranks; ESP groups inside a node (Section IV-A case 2) or EP groups
    mp_size: int = 1
    esp_size: int = 1
    esp_in_node: bool = True
    # the dense (non-expert) part: replicated on every rank, or sharded by FSDP2 over the
    # data-parallel ranks (moeflow.parallel.fsdp); the experts keep their EP / FSSDP layout
    dense_shard: str = "replicate"
    # reproducible runs (docs/training.md, "Reproducible runs"): no timing-based choice (the
    # auto-tuned exchange settings are fixed: recorded ones or the untuned defaults, never
    # re-tuned) and torch's deterministic algorithms
    deterministic: bool = False
    # a run folder whose recorded tuner choices (its autotune.jsonl) the MoE layers start with
    tuned_from: str | None = None
    # pipeline parallelism (docs/training.md, "Pipeline parallelism"): the GPT's blocks cut
    # into pp stages (2 virtual stages per rank for interleaved-1f1b, zbv, dualpipev), the
    # grad_accum micro-batches run through them by torch.distributed.pipelining's schedule
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_layout: str = "across-nodes"
    # dualpipev's OVERLAP_F_B pairs: one micro-batch's all-to-all in flight while the other
    # computes (DeepSeek-V3 Section 3.2.1); "off" runs the pair's halves one after the other
    pp_overlap: str = "auto"

    # the moeflow train option of each field: --field-name, except these
    FLAGS = {"collective_timeout_s": "--timeout", "mp_size": "--mp", "esp_size": "--esp",
             "esp_in_node": "--esp-placement", "pp": "--pp", "pp_schedule": "--pp-schedule",
             "pp_layout": "--pp-layout", "pp_overlap": "--pp-overlap"}

    @classmethod
    def flag(cls, name: str) -> str:
        return cls.FLAGS.get(name, "--" + name.replace("_", "-"))

    def _require(self, cond: bool, name: str, fix: str) -> None:
        if not cond:
            err = config_error("TrainConfig", name, getattr(self, name), fix)
            raise ConfigError(f"{self.flag(name)}: {err}")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "log_every"):
            v = getattr(self, name)
            self._require(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                          "must be a positive integer")
        v = self.grad_accum
        self._require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, "grad_accum",
                      "must be an integer >= 1 (micro-batches of --batch-size sequences per "
                      "optimizer step; 1: no accumulation)")
        if self.warmup_steps is None:
            self.warmup_steps = min(30, self.steps // 10)
        self._require(self.lr > 0, "lr", "must be > 0")
        self._require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        self._require(isinstance(self.warmup_steps, int) and 0 <= self.warmup_steps <= self.steps,
                      "warmup_steps", f"must be in [0, steps={self.steps}] (unset: "
                      f"min(30, steps // 10) = {min(30, self.steps // 10)})")
        self._require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self._require(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)")
        self._require(isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0,
                      "checkpoint_every", "must be >= 0 (0: at the end only)")
        self._require(self.collective_timeout_s > 0, "collective_timeout_s",
                      "must be > 0 seconds")
        if self.ep_size is not None:
            self._require(isinstance(self.ep_size, int) and not isinstance(self.ep_size, bool)
                          and self.ep_size > 0, "ep_size", "must be a positive integer")
        for name in ("mp_size", "esp_size"):
            v = getattr(self, name)
            self._require(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                          "must be a positive integer (1: no Parm parallelism of that kind)")
        self._require(self.recompute in TRAIN_RECOMPUTES, "recompute",
                      "choose 'none', 'full' (recompute every block in backward) or 'moe_act' "
                      "(keep the MoE layers' exchanged tokens, recompute their experts)")
        self._require(self.dense_shard in DENSE_SHARDS, "dense_shard",
                      "choose 'replicate' (every rank holds the dense weights whole) or 'fsdp' "
                      "(FSDP2 shards them over the data-parallel ranks)")
        self._require(self.device in DEVICES, "device",
                      f"choose one of {', '.join(DEVICES)} (auto: cuda when a GPU is visible)")
        self._require(self.dtype in DTYPES, "dtype",
                      f"choose one of {', '.join(DTYPES)} (auto: bf16 autocast on cuda, fp32 "
                      "on cpu)")
        self._require(isinstance(self.deterministic, bool), "deterministic",
                      "must be True or False")
        self._require(self.tuned_from is None or isinstance(self.tuned_from, str), "tuned_from",
                      "must be a run folder (the --out of a 'moeflow train' run) or unset")
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        """``--pp`` / ``--pp-schedule``, and what pipeline parallelism does not compose with."""
        v = self.pp
        self._require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, "pp",
                      "must be an integer >= 1 (pipeline stages; 1: no pipeline parallelism)")
        self._require(self.pp_schedule in PP_SCHEDULES, "pp_schedule",
                      f"choose one of {', '.join(PP_SCHEDULES)}")
        self._require(self.pp_layout in PP_LAYOUTS, "pp_layout",
                      f"choose one of {', '.join(PP_LAYOUTS)} (across-nodes: a stage is a "
                      "block of consecutive ranks, the pipeline crosses the nodes; "
                      "within-nodes: a stage is strided over the nodes, each node holds whole "
                      "pipelines)")
        self._require(self.pp_overlap in PP_OVERLAPS, "pp_overlap",
                      f"choose one of {', '.join(PP_OVERLAPS)} (auto: on with --pp-schedule "
                      "dualpipev)")
        self._require(self.pp_overlap != "on" or self.pp_schedule == "dualpipev", "pp_overlap",
                      f"only --pp-schedule dualpipev has overlapped forward / backward pairs "
                      f"(--pp-schedule is {self.pp_schedule}); use --pp-overlap auto or off, "
                      "or --pp-schedule dualpipev")
        if self.pp == 1:
            return
        refused = [(self.dense_shard != "replicate", "dense_shard", "--dense-shard replicate"),
                   (self.mp_size != 1, "mp_size", "--mp 1"),
                   (self.esp_size != 1, "esp_size", "--esp 1"),
                   (self.recompute != "none", "recompute", "--recompute none")]
        for bad, name, fix in refused:
            if bad:
                err = config_error("TrainConfig", name, getattr(self, name),
                                   f"it does not compose with pipeline parallelism (--pp "
                                   f"{self.pp}) yet; use {fix} or --pp 1")
                raise ConfigError(f"{self.flag(name)} with --pp: {err}")
        n, pp, sched = self.grad_accum, self.pp, self.pp_schedule
        need = 2 * pp if sched == "dualpipev" else pp
        self._require(n >= need, "grad_accum",
                      f"--pp-schedule {sched} on --pp {pp} needs at least {need} micro-batches "
                      f"per step (the --grad-accum micro-batches are the pipeline's); use "
                      f"--grad-accum {need} or more")
        rounds = max(1, n // pp)
        self._require(sched != "interleaved-1f1b" or n % rounds == 0, "grad_accum",
                      f"--pp-schedule interleaved-1f1b runs the micro-batches in rounds of "
                      f"--pp {pp}: use a multiple of {pp}")
        self._require(self.eval_batches % n == 0, "eval_batches",
                      f"with --pp the validation batches go through the pipeline "
                      f"--grad-accum {n} at a time: use a multiple of {n}")
