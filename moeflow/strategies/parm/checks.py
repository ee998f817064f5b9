"""What Parm's schedules can run: the combinations refused, with the fix (docs/parm.md)."""

from __future__ import annotations

from moeflow.config import ConfigError, MoEConfig
from moeflow.strategies.parm.baseline import esp_peers_share_tokens
from moeflow.topology import Topology

# all-to-all algorithms that only use the group's own ranks (the hierarchical ones assume that
# EP groups map onto nodes, which ESP and the EP&ESP block change)
ESP_ALLTOALLS = ("direct", "pairwise")
# how the ted schedule's chunks run (strategies/parm/ted_pipelined.py): its own pipeline
TED_SCHEDULERS = ("sequential", "pipelined")


def uses_parm(topo: Topology) -> bool:
    return topo.mp_size > 1 or topo.esp_size > 1


def check_parm_layer(cfg: MoEConfig, topo: Topology, hidden: int) -> None:
    """Refuse, with the fix, what the chosen schedule with this layout cannot run."""
    sched = cfg.parallel_schedule
    paused = sched != "baseline" and uses_parm(topo)       # S1, S2, auto, ted
    if topo.esp_size > 1 and hidden % topo.esp_size:
        raise ConfigError(
            f"MoEConfig.d_expert={cfg.d_expert} (expert hidden width {hidden}) is invalid for "
            f"esp_size={topo.esp_size}: each expert's hidden dimension is split over the ESP "
            f"group, so it must be a multiple of {topo.esp_size}; change d_expert or esp_size")
    if (topo.esp_size > 1 or paused) and cfg.a2a not in ESP_ALLTOALLS:
        raise ConfigError(
            f"MoEConfig.a2a={cfg.a2a!r} is not supported with esp_size={topo.esp_size}, "
            f"mp_size={topo.mp_size}, parallel_schedule={sched!r}: the hierarchical "
            "algorithms assume EP groups laid over nodes, which expert sharding and the EP&ESP "
            f"block change; use one of {', '.join(ESP_ALLTOALLS)}")
    if (topo.esp_size > 1 or paused) and cfg.router == "bilevel":
        raise ConfigError(
            f"MoEConfig.router='bilevel' is not supported with esp_size={topo.esp_size}, "
            f"mp_size={topo.mp_size}, parallel_schedule={sched!r}: SMILE's node-level routing "
            "assumes one expert group per node of the EP group; use router='topk', or "
            "esp_size=1 (with S1 / S2 also mp_size=1, or parallel_schedule='baseline')")
    if (sched == "baseline" and topo.mp_size > 1 and cfg.gate_noise > 0
            and esp_peers_share_tokens(topo)):
        why = ("the ESP peers send their own copies of the MP group's tokens to their shards, "
               "whose partial outputs are summed" if topo.esp_size > 1 else
               "the MP ranks split one dispatch plan (each sends its share of every expert's "
               "rows, DeepSpeed-MoE's duplicate-token drop)")
        raise ConfigError(
            f"MoEConfig.gate_noise={cfg.gate_noise} is not supported with "
            f"parallel_schedule='baseline', mp_size={topo.mp_size}, esp_size={topo.esp_size} "
            f"and the ESP groups inside the MP groups: {why}, so the MP ranks must route "
            "identically, and the noise is drawn per rank; use gate_noise=0, or a layout whose "
            "ESP groups cross the MP groups")
    if not paused or sched == "s1":
        return
    if topo.mp_size > 1 and cfg.gate_noise > 0:
        raise ConfigError(
            f"MoEConfig.gate_noise={cfg.gate_noise} is not supported with "
            f"parallel_schedule={sched!r} and mp_size={topo.mp_size}: S2 splits one plan "
            "over the MP group, so its ranks must route identically, and the noise is drawn "
            "per rank; use gate_noise=0 or parallel_schedule='s1'")
    if sched == "ted":
        check_ted(cfg, cfg.pipeline_degree)
        return
    check_saa(cfg, cfg.pipeline_degree)


def check_ted(cfg: MoEConfig, pipeline_degree: int) -> None:
    """The ``ted`` schedule's exchange runs its own collectives: no codecs; its chunks
    (``pipeline_degree`` > 1, :mod:`.ted_pipelined`) run one after the other
    (``schedule="sequential"``) or pipelined (``"pipelined"``), no other scheduler."""
    if cfg.codec != "none":
        raise ConfigError(
            f"MoEConfig.parallel_schedule='ted' is not supported with codec={cfg.codec!r}: "
            "its node-once exchange (EP-AlltoAll, ESP-AllGather, ESP-ReduceScatter) runs "
            "without codecs; set codec='none', or use parallel_schedule='s1' / 's2' with "
            "parm_saa=False")
    if pipeline_degree > 1 and cfg.schedule not in TED_SCHEDULERS:
        raise ConfigError(
            f"MoEConfig.schedule={cfg.schedule!r} is not supported with "
            f"parallel_schedule='ted' and pipeline_degree={pipeline_degree}: the ted "
            "schedule's chunks run one after the other ('sequential') or pipelined, chunk "
            "c+1's EP-AlltoAll under chunk c's ESP collectives and experts ('pipelined'); "
            f"set schedule to one of {', '.join(TED_SCHEDULERS)}")


def check_saa(cfg: MoEConfig, pipeline_degree: int) -> None:
    """SAA (S2's phased all-to-all with the MP-AllGather) takes neither codecs nor chunks."""
    if not cfg.parm_saa or cfg.parallel_schedule == "s1":
        return
    if cfg.codec != "none" or pipeline_degree > 1:
        raise ConfigError(
            f"MoEConfig.parm_saa=True is not supported with codec={cfg.codec!r}, "
            f"pipeline_degree={pipeline_degree} (parallel_schedule="
            f"{cfg.parallel_schedule!r}): SAA runs its own phased all-to-all with the experts "
            "between the two exchanges, without codecs or chunks; set parm_saa=False (AAS: "
            "the EP&ESP exchange through the pipeline, then the MP-AllGather), or codec='none' "
            "and pipeline_degree=1")
