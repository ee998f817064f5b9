"""``moeflow bench layer``'s configs (Switch top-1, GShard top-2, dropless variants, one row per
further schedule and all-to-all algorithm), their inputs and their routing, shared with
``moeflow simulate layer`` (ScheMoE Section 4's layer, predicted row by row)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moeflow.config import MoEConfig
from moeflow.routing.choices import router_choices


@dataclass
class BenchCase:
    name: str
    num_experts: int
    top_k: int
    capacity_factor: float | None
    activation: str = "gelu"
    schedule: str = "sequential"
    pipeline_degree: int = 1
    grouped_mm: bool = True          # False: dropless experts as one matmul per expert
    a2a: str = "direct"
    codec: str = "none"              # MoEConfig.codec (bench layer --codec)
    codec_backward: bool = False     # MoEConfig.codec_backward (--codec-backward)


DEFAULT_CASES = [
    BenchCase("switch-top1-cap1.25", 8, 1, 1.25),
    BenchCase("gshard-top2-cap1.25", 8, 2, 1.25),
    BenchCase("dropless-top2", 8, 2, None),
    BenchCase("dropless-top2-loop", 8, 2, None, grouped_mm=False),
    BenchCase("dropless-top2-swiglu", 8, 2, None, "swiglu"),
]


def cases_for(schedules: list[str], r: int, algorithms: tuple[str, ...] = ("direct",),
              num_experts: int = 8) -> list[BenchCase]:
    """The default configs, then GShard top-2 under each further schedule at degree ``r``;
    each under every all-to-all algorithm of ``algorithms`` (named ``config@algorithm`` when
    there are several); every config with ``num_experts`` experts (a multiple of the world:
    6 or 12 on 3 nodes of 2 ranks)."""
    extra = [BenchCase(f"gshard-top2-{s}-r{r}", 8, 2, 1.25, schedule=s, pipeline_degree=r)
             for s in schedules if s != "sequential"]
    cases = [replace(c, num_experts=num_experts) for c in DEFAULT_CASES + extra]
    if list(algorithms) == ["direct"]:
        return cases
    return [replace(c, name=f"{c.name}@{a}", a2a=a) for a in algorithms for c in cases]


# exchanges benchmarked beside the all-to-all algorithms that are strategies of their own
# (MoEConfig.placement): ``--algorithms direct,node_dedup`` compares them side by side;
# ``auto`` is placement="auto", the auto-tuner's pick of direct expert parallelism or
# node_dedup, measured at the config's schedule (docs/autotune.md, "Tuning the placement")
EXCHANGE_STRATEGIES = ("node_dedup", "auto")


def exchange_fields(name: str) -> dict:
    """The MoEConfig fields that select exchange ``name``: an all-to-all algorithm (``a2a``)
    or a strategy with its own exchange (``placement``)."""
    return {"placement": name} if name in EXCHANGE_STRATEGIES else {"a2a": name}


def case_config(case: BenchCase, d_model: int, d_expert: int) -> MoEConfig:
    return MoEConfig(d_model=d_model, d_expert=d_expert, num_experts=case.num_experts,
                     top_k=case.top_k, capacity_factor=case.capacity_factor,
                     activation=case.activation, seed=1, schedule=case.schedule,
                     pipeline_degree=case.pipeline_degree, codec=case.codec,
                     codec_backward=case.codec_backward, **exchange_fields(case.a2a))


def with_codec(cases: list[BenchCase], codec: str, backward: bool) -> list[BenchCase]:
    """Every case under ``codec`` (``--codec`` / ``--codec-backward``), names unchanged: the
    rows of ``moeflow simulate layer --codec NAME`` carry the same names, and each row records
    its ``codec`` and ``codec_backward`` (which ``simulate layer --measured`` checks)."""
    return [replace(c, codec=codec, codec_backward=backward) for c in cases]


def case_input(tokens: int, d_model: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input tokens (the same in every timed step)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(tokens, d_model, generator=gen)


def case_routing(case: BenchCase, world: int, tokens: int, d_model: int,
                 d_expert: int) -> list[torch.Tensor]:
    """The ``(tokens, top_k)`` expert ids each rank's router picks in ``moeflow bench layer``'s timed steps (the
    router is built from the config alone and no step changes it): the routing sample that
    ``moeflow simulate layer`` plans, so its bytes are those of the measured run."""
    return router_choices(case_config(case, d_model, d_expert),
                          [case_input(tokens, d_model, p) for p in range(world)])
