"""HECATE's fully sharded sparse data parallelism (HECATE Sections 3-4) as a strategy.

Experts are stored sharded over all ranks (:class:`~.layer_experts.FSSDPExperts`, built by
``build_experts``): ``begin`` finishes the sparse AllGather of this iteration's experts
(Section 3.2; started early by ``overlap`` before the layer, Fig. 1c), ``dispatch`` plans to
the ranks holding a copy (Section 4.4), and ``exchange`` frees the held copies after the
experts ran (HECATE-RM, re-materialization, Section 3.2) where the backward re-gathers them.
With ``MoEConfig.recompute="moe_act"`` the forward keeps the experts' input rows and the held
copy's weights (views of the stacked tensor, the storage HECATE-RM frees and refills), and the
backward's expert task recomputes the experts with them: no collective is added.
Under activation checkpointing the recomputation re-gathers the recorded ``P'`` and reuses the
first forward's plan (:mod:`moeflow.plan_record`): one ``P'``, one count exchange and one load
window entry per step.

At the model level: one slot tensor for all layers (Algorithm 2, ``setup_model``), re-sharding
and re-placement after optimizer steps (``on_step_end``: ``fssdp.reshard_every`` /
``replace_every``), the checkpoint entries (:mod:`.checkpoint_entries`) and the training
metrics (:mod:`.metrics`).
"""

from __future__ import annotations

import torch

from moeflow.errors import ConfigError
from moeflow.strategies.base import ExpertStrategy, register_strategy
from moeflow.strategies.fssdp.checkpoint_entries import fssdp_checkpoint_entries
from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
from moeflow.strategies.fssdp.metrics import fssdp_metrics
from moeflow.strategies.fssdp.options import FSSDPOptions
from moeflow.strategies.fssdp.replace import maybe_replace
from moeflow.strategies.fssdp.reshard import fssdp_layers, maybe_reshard, share_slots


@register_strategy("fssdp")
class FSSDP(ExpertStrategy):
    """Owner-only expert storage, gathered per iteration; ``layer.experts`` is an
    ``FSSDPExperts``. Capacity padding is laid out by its plan, never trimmed."""

    OPTIONS = FSSDPOptions
    trims_padding = False
    supports_trim = False
    tunable_fields = ()      # the tuner times the expert-parallel exchange only
    counts_inter_node_bytes = False

    @classmethod
    def check_config(cls, cfg, topo) -> None:
        """It shards experts over the whole world, so expert parallelism must span it, and
        Parm's MP/ESP shards are a different storage (docs/hecate.md)."""
        if topo.ep_size != topo.world_size:
            raise ConfigError(f"MoEConfig.placement='fssdp' shards experts over all ranks, but "
                              f"the topology has ep_size={topo.ep_size} of {topo.world_size}: "
                              "use ep_size=None (all ranks)")
        if topo.esp_size > 1 or topo.mp_size > 1:
            raise ConfigError("MoEConfig.placement='fssdp' cannot be combined with Parm's "
                              f"MP/ESP (mp_size={topo.mp_size}, esp_size={topo.esp_size}): "
                              "FSSDP keeps whole experts; use mp_size=esp_size=1 or "
                              "placement='ep'")
        if cfg.expert_module != "ffn":
            raise ConfigError(
                "MoEConfig.placement='fssdp' stores the built-in expert FFN in its slot rows, "
                f"so expert_module={cfg.expert_module!r} cannot be used with it: use "
                "expert_module='ffn', or placement='ep'")

    @classmethod
    def refuses_block_recompute(cls, cfg):
        if cfg.fssdp is not None and cfg.fssdp.overlap_regather:
            return ("MoEConfig.fssdp.overlap_regather=True",
                    "the blocks' recomputation gathers the experts itself (HECATE-RM frees "
                    "nothing to re-gather early); set fssdp.overlap_regather=false or use "
                    "--recompute none")
        return None

    def build_experts(self) -> FSSDPExperts:
        from moeflow.experts.structure import comm_width, expert_hidden

        cfg, topo = self.layer.cfg, self.layer.topo
        return FSSDPExperts(comm_width(cfg), expert_hidden(cfg), cfg.num_experts,
                            cfg.activation, cfg.seed, cfg.layer_id, cfg.expert_bias, cfg.fssdp,
                            rank=topo.rank, world=topo.world_size, local_size=topo.local_size,
                            group=topo.world_group, activation_options=cfg.activation_options,
                            lane_group=topo.lane_group)

    def overlap(self, lane, grad=None) -> None:
        experts = self.layer.experts
        if grad is not None:
            experts.regather_on_grad(grad, lane)      # no-op unless overlap_regather
        elif self.layer.cfg.fssdp.early_gather:
            experts.prefetch(lane)

    def begin(self, h, call):
        experts = self.layer.experts
        if call.replay:                               # the recorded P', gathered again
            return h, experts.replay_begin(call.state)
        return h, experts.begin(self.layer.lane)      # spAG(P, P') done

    def _plan(self, expert_ids, cap, device, call):
        # a checkpoint's first forward is a training forward even without grad (reentrant)
        plan = self.layer.experts.plan(expert_ids, cap,
                                       torch.is_grad_enabled() or call.checkpointed)
        call.state = self.layer.experts.last_placement     # P', after any calibration
        return plan

    def dispatch(self, h, weights, expert_ids, cap, call):
        if call.replay:
            call.plan = self.layer.experts.replay_plan(call.plan, call.state)
        return super().dispatch(h, weights, expert_ids, cap, call)

    def exchange(self, send, runner, tokens, call):
        back, shared_y = super().exchange(send, runner, tokens, call)
        return self.layer.experts.end(back, call.checkpointed, timed=not call.replay), shared_y

    def stats(self) -> dict[str, float]:
        return self.layer.experts.stats()

    @classmethod
    def setup_model(cls, model, layers) -> None:
        share_slots(fssdp_layers(model))              # Algorithm 2: one slot tensor per rank

    @classmethod
    def on_step_end(cls, model, layers, optimizer, step) -> None:
        maybe_reshard(model, optimizer, step)         # Algorithm 2 (fssdp.reshard_every)
        maybe_replace(model, optimizer, step)         # SmartMoE-style (fssdp.replace_every)

    @classmethod
    def checkpoint_entries(cls, model, layers, optimizer, optimizer_state):
        return fssdp_checkpoint_entries(model, optimizer, optimizer_state)

    @classmethod
    def metrics(cls, model, layers) -> dict:
        return fssdp_metrics(model)
