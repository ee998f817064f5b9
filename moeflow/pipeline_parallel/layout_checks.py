"""What ``moeflow train --pp`` can run, checked before the ranks start (and again when a rank
builds its stages): the stage size, its placement on the nodes (``--pp-layout``), the EP size
inside a stage, the blocks per stage, and the
expert strategies that compose with pipeline parallelism (plain expert parallelism), and no
auto-tuned exchange setting (the tuner's timings are world-wide collectives)."""

from __future__ import annotations

from moeflow.autotune.tuner import auto_fields
from moeflow.config import ModelConfig, TrainConfig
from moeflow.errors import ConfigError
from moeflow.pipeline_parallel.pipeline_schedules import num_stages
from moeflow.pipeline_parallel.split import stage_blocks

PP_PLACEMENTS = ("ep",)        # MoEConfig.placement values that compose with --pp
# what --pp runs instead of the auto-tuned exchange settings (the tuner's untuned defaults)
PP_FIXED = {"a2a": "direct", "schedule": "sequential", "pipeline_degree": 1, "codec": "none"}


def check_pipeline(mcfg: ModelConfig, tcfg: TrainConfig, world: int,
                   local: int | None = None) -> int:
    """Raise ``ConfigError`` naming the flags when ``--pp`` cannot run this model on ``world``
    ranks (nodes of ``local`` ranks, default one node; ``--pp-layout`` places the stages on
    them); return the stage group size (ranks per pipeline rank)."""
    from moeflow.pipeline_parallel.mesh import stage_ranks_per_node, stage_size

    size = stage_size(world, tcfg.pp)
    stage_ranks_per_node(world, tcfg.pp, local or world, tcfg.pp_layout)
    stage_blocks(mcfg.n_layers, num_stages(tcfg.pp_schedule, tcfg.pp))
    ep = tcfg.ep_size or size
    if size % ep:
        raise ConfigError(f"--ep-size {ep} is invalid with --pp {tcfg.pp} on {world} ranks: "
                          f"the EP groups live inside a stage of {size} ranks; pick one of "
                          f"{[d for d in range(1, size + 1) if size % d == 0]}")
    for i in mcfg.moe_layer_ids():
        placement = mcfg.moe_config(i).placement
        if placement not in PP_PLACEMENTS:
            raise ConfigError(f"--set moe.placement={placement} with --pp {tcfg.pp}: only "
                              f"{', '.join(PP_PLACEMENTS)} composes with pipeline parallelism "
                              "yet; use --set moe.placement=ep or --pp 1")
        if mcfg.moe_config(i).parallel_schedule != "baseline":
            raise ConfigError(f"--set moe.parallel_schedule="
                              f"{mcfg.moe_config(i).parallel_schedule} with --pp {tcfg.pp}: "
                              "Parm's schedules do not compose with pipeline parallelism "
                              "yet; use baseline or --pp 1")
        auto = auto_fields(mcfg.moe_config(i))
        if auto:
            fix = " ".join(f"--set moe.{f}={PP_FIXED[f]}" for f in auto)
            raise ConfigError(f"--set moe.{auto[0]}={getattr(mcfg.moe_config(i), auto[0])} "
                              f"with --pp {tcfg.pp}: the auto-tuner times its candidates with "
                              "world-wide barriers, which the other pipeline stages do not "
                              f"join inside a schedule; fix the exchange settings ({fix}) or "
                              "use --pp 1")
        if mcfg.moe_config(i).recompute != "none":
            raise ConfigError(f"--set moe.recompute={mcfg.moe_config(i).recompute} with --pp "
                              f"{tcfg.pp}: activation recomputation is not proven under the "
                              "pipeline schedules yet; leave moe.recompute=none or use --pp 1")
    return size
