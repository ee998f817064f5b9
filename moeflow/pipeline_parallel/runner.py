"""One rank's part of a pipeline-parallel training step (``moeflow train --pp``): its stages
(:mod:`moeflow.pipeline_parallel.stage_model`) wrapped in ``torch.distributed.pipelining``'s
``PipelineStage`` and driven by the chosen schedule
(:mod:`moeflow.pipeline_parallel.pipeline_schedules`) over
the step's ``grad_accum`` micro-batches, then the gradient work of an optimizer step across
the stages (:mod:`moeflow.pipeline_parallel.grads`).

A step's loss is the unpipelined one: each micro-batch contributes ``(ce_i + aux_i) / N`` (the
last stage's ``loss_fn`` returns ``ce_i / N``, every stage carries its ``aux_i`` with weight
``1 / N``), so the gradients equal ``moeflow.trainer.accumulate_gradients``' on the same
micro-batches. The logged statistics ``[ce, aux, balance]`` are summed over the pipeline ranks
(each stage holds its own MoE layers' part; the last stage the cross-entropy), so every rank
holds its data-parallel position's full values.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining.schedules import OVERLAP_F_B

from moeflow.comm import wait_watch

from moeflow.config import ModelConfig, TrainConfig
from moeflow.devices import autocast
from moeflow.parallel.grad_sync import sync_gradients
from moeflow.pipeline_parallel.a2a_clock import A2AClock
from moeflow.pipeline_parallel.layout_checks import check_pipeline
from moeflow.pipeline_parallel.overlap_fb import PairThreads, overlaps, run_overlapped_pair
from moeflow.pipeline_parallel.grads import clip_pipeline_gradients, sum_tied_embedding
from moeflow.pipeline_parallel.mesh import PipelineMesh, build_pipeline_mesh
from moeflow.pipeline_parallel.pipeline_schedules import (VIRTUAL_STYLE, build_eval_schedule,
                                                          build_schedule, num_stages,
                                                          stage_ids)
from moeflow.pipeline_parallel.split import stage_blocks
from moeflow.pipeline_parallel.stage_model import GPTStage, PipelineModel


def _no_weight_step() -> None:
    """The W step of a stage whose weight gradients were computed in its I step."""


def _no_weight_runner():
    return _no_weight_step


def _weights_in_input_step(stage: GPTStage):
    """``dw_builder`` of a stage with MoE layers: the zero-bubble schedules (zbv, dualpipev;
    Qi et al. 2024 Section 2) split a backward into the input gradient (I) and the weight
    gradient (W), differentiating the graph twice; the MoE layers' autograd functions run
    their exchanges' backward once and free what they saved, so such a stage computes both in
    its I step and its W step is empty (torch's ``dw_builder`` protocol). Stages without MoE
    layers split (None)."""
    return _no_weight_runner if stage.moe_layers() else None


class PipelineRunner:
    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, device: torch.device,
                 dtype: torch.dtype | None = None, param_dtype: torch.dtype | None = None,
                 mesh: PipelineMesh | None = None):
        """Build this rank's stages (torch.distributed initialised). ``dtype``: the forward's
        autocast dtype (None or float32: none); ``param_dtype``: cast the parameters (float64
        in the exactness tests)."""
        from torch.distributed.pipelining import PipelineStage

        self.cfg, self.device = train_cfg, device
        world = dist.get_world_size()
        check_pipeline(model_cfg, train_cfg, world)
        sched, pp, n = train_cfg.pp_schedule, train_cfg.pp, train_cfg.grad_accum
        v_shape = VIRTUAL_STYLE.get(sched) == "v"
        self.mesh = mesh or build_pipeline_mesh(pp, train_cfg.ep_size,
                                                tied_across_ranks=not v_shape,
                                                layout=train_cfg.pp_layout)
        n_stages = num_stages(sched, pp)
        blocks = stage_blocks(model_cfg.n_layers, n_stages)
        stages: list[GPTStage] = []
        for sid in stage_ids(sched, pp, self.mesh.pp_rank):
            shared = stages[0].tok if stages and stages[0].is_first else None
            stages.append(GPTStage(model_cfg, self.mesh.stage, blocks[sid], sid == 0,
                                   sid == n_stages - 1, 1.0 / n, tok=shared))
        for s in stages:
            if param_dtype is not None:
                s.to(device=device, dtype=param_dtype)
            else:
                s.to(device)
        self.model = PipelineModel(stages)
        self.stage_ids = stage_ids(sched, pp, self.mesh.pp_rank)
        act = param_dtype or torch.float32
        self.pipe_stages = [PipelineStage(s, sid, n_stages, device, group=self.mesh.pp_group,
                                          dw_builder=_weights_in_input_step(s),
                                          **self._metadata(model_cfg, train_cfg, s, act, dtype))
                            for s, sid in zip(stages, self.stage_ids)]
        self.n_micro = n
        self.autocast_dtype = dtype
        self.schedule = build_schedule(sched, self.pipe_stages, n, self._loss)
        self.eval_schedule = (build_eval_schedule(sched, self.pipe_stages, n, pp, self._loss)
                              or self.schedule)
        self.a2a_clock = A2AClock()
        self.overlap = overlaps(train_cfg)
        if self.overlap:
            self.schedule.register_custom_function(OVERLAP_F_B, functools.partial(
                run_overlapped_pair, clock=self.a2a_clock, threads=PairThreads(),
                device_type=device.type,
                timeout_s=train_cfg.collective_timeout_s))
        self.has_first = 0 in self.stage_ids
        self.has_last = n_stages - 1 in self.stage_ids

    @staticmethod
    def _metadata(mcfg: ModelConfig, tcfg: TrainConfig, stage: GPTStage, act: torch.dtype,
                  autocast_dtype: torch.dtype | None) -> dict:
        """The stage's input and output shapes and dtypes (a micro-batch of ``batch_size``
        sequences; meta tensors), given so torch runs no extra forward to infer them (an extra
        forward would run the MoE layers' exchanges and count their loads once more)."""
        shape = (tcfg.batch_size, mcfg.seq_len)
        meta = torch.device("meta")
        inp = (torch.empty(shape, dtype=torch.long, device=meta) if stage.is_first
               else torch.empty(shape + (mcfg.d_model,), dtype=act, device=meta,
                                requires_grad=True))
        if stage.is_last:
            logits = autocast_dtype if autocast_dtype not in (None, torch.float32) else act
            out = torch.empty(shape + (mcfg.vocab_size,), dtype=logits, device=meta,
                              requires_grad=True)
        else:       # activations that carry a gradient back (requires_grad, as in training)
            out = torch.empty(shape + (mcfg.d_model,), dtype=act, device=meta,
                              requires_grad=True)
        return {"input_args": (inp,), "output_args": (out,)}

    # ---- the data-parallel position -----------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh.stage.rank

    @property
    def dp_size(self) -> int:
        return self.mesh.stage.world_size

    # ---- a step ---------------------------------------------------------------------------
    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: its share ``ce / N`` of the step's."""
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return ce / self.n_micro

    def _run(self, x: torch.Tensor, y: torch.Tensor, train: bool) -> torch.Tensor:
        """One schedule run over the ``N`` micro-batches of ``x`` / ``y`` (stacked on dim 0):
        the sum of the micro-batches' cross-entropies on the last stage (else 0)."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        target = y if self.has_last else None
        previous = wait_watch.install(self.a2a_clock if train else None)
        try:
            with autocast(self.device, self.autocast_dtype or torch.float32):
                if train:
                    self.schedule.step(*args, target=target, losses=losses,
                                       return_outputs=False)
                else:
                    self.eval_schedule.eval(*args, target=target, losses=losses)
        finally:
            wait_watch.install(previous)
        if not losses:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack([l.detach().double() for l in losses]).sum() * self.n_micro

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The step's forwards and backwards (gradients added into ``.grad``, not
        synchronised); returns ``[ce, aux_loss, balance_loss]``, means over the micro-batches,
        summed over the stages (float64, on the device, not read)."""
        for s in self.model.stages:
            s.aux_log.clear()
            s.balance_log.clear()
        ce_sum = self._run(x.to(self.device), y.to(self.device), train=True)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        aux = sum((torch.stack(s.aux_log).sum() for s in self.model.stages if s.aux_log), zero)
        bal = sum((torch.stack(s.balance_log).sum() for s in self.model.stages
                   if s.balance_log), zero)
        stats = torch.stack([ce_sum, aux, bal]) / self.n_micro
        dist.all_reduce(stats, group=self.mesh.pp_group)
        return stats

    def take_a2a_times(self) -> dict[str, float]:
        """This rank's MoE all-to-all time in the training steps since the last call
        (:class:`~moeflow.pipeline_parallel.a2a_clock.A2AClock`: ``a2a_exposed_s``,
        ``a2a_total_s``, ``a2a_count``)."""
        return self.a2a_clock.take()

    def sync_and_clip(self, max_norm: float) -> torch.Tensor:
        """Once per optimizer step: the data-parallel synchronisation inside each stage group,
        the tied embedding's sum, the global norm and the clipping; returns the norm."""
        sync_gradients(self.model, self.mesh.stage)
        sum_tied_embedding(self.model, self.mesh)
        return clip_pipeline_gradients(self.model, self.mesh, max_norm)

    @torch.no_grad()
    def evaluate_batches(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The summed mean cross-entropy of ``batches`` (a multiple of ``N`` equal batches; each
        one micro-batch, as the unpipelined evaluation runs it), summed over the pipeline
        ranks: a float64 0-dim tensor on the device."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(0, len(batches), self.n_micro):
            group = batches[i:i + self.n_micro]
            x = torch.cat([b[0] for b in group]).to(self.device)
            y = torch.cat([b[1] for b in group]).to(self.device)
            total += self._run(x, y, train=False)
        self.model.train()
        dist.all_reduce(total, group=self.mesh.pp_group)
        return total
