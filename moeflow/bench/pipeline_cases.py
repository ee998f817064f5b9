"""The configurations ``moeflow bench pipeline`` compares, from its ``--configs`` list, and
the ``TrainConfig`` of each at one global batch: ``ep`` (expert parallelism over every rank,
no pipeline) and ``pp<N>:<schedule>[:<layout>][:overlap=<auto|on|off>]`` (``N`` pipeline
stages on groups of ``world / N`` ranks, each expert parallel over its own ranks;
torch.distributed.pipelining's schedules, docs/training.md "Pipeline parallelism"; ``overlap``:
``--pp-overlap``, DualPipe's overlapped forward / backward pairs, DeepSeek-V3 Section 3.2.1)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from moeflow.config import TrainConfig
from moeflow.config.training import PP_LAYOUTS, PP_OVERLAPS, PP_SCHEDULES
from moeflow.errors import ConfigError

_PP = re.compile(r"^pp(\d+):([a-z0-9-]+)(?::([a-z-]+))?(?::overlap=([a-z]+))?$")


@dataclass(frozen=True)
class PipelineCase:
    name: str                     # as given in --configs
    pp: int = 1
    schedule: str = "1f1b"
    layout: str = "across-nodes"
    overlap: str = "auto"         # TrainConfig.pp_overlap


def parse_cases(text: str) -> list[PipelineCase]:
    """``--configs``: comma-separated ``ep`` / ``pp<N>:<schedule>[:<layout>][:overlap=<o>]``,
    each once."""
    cases = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        if item == "ep":
            cases.append(PipelineCase("ep"))
            continue
        m = _PP.match(item)
        if m is None or int(m[1]) < 2 or m[2] not in PP_SCHEDULES or \
                (m[3] is not None and m[3] not in PP_LAYOUTS) or \
                (m[4] is not None and m[4] not in PP_OVERLAPS):
            raise ConfigError(f"--configs has {item!r}: give ep or pp<N>:<schedule>[:<layout>]"
                              f"[:overlap=<o>] with N >= 2, schedule one of "
                              f"{', '.join(PP_SCHEDULES)}, layout one of {', '.join(PP_LAYOUTS)} "
                              f"(default across-nodes), o one of {', '.join(PP_OVERLAPS)} "
                              "(--pp-overlap, default auto), e.g. "
                              "ep,pp2:1f1b,pp2:dualpipev:within-nodes,pp2:dualpipev:overlap=off")
        cases.append(PipelineCase(item, int(m[1]), m[2], m[3] or "across-nodes",
                                  m[4] or "auto"))
    if not cases or len({c.name for c in cases}) < len(cases):
        raise ConfigError(f"--configs {text!r}: give at least one configuration, each once")
    return cases


def case_train_config(case: PipelineCase, world: int, global_batch: int, micro: int,
                      steps: int) -> TrainConfig:
    """The ``TrainConfig`` of ``case`` on ``world`` ranks at ``global_batch`` sequences per
    step: ``ep`` one batch of ``global_batch / world`` per rank (no accumulation), a pipeline
    ``micro`` micro-batches of ``global_batch / (world / N x micro)`` per stage position."""
    if world % case.pp:
        raise ConfigError(f"--configs {case.name}: {case.pp} stages do not divide {world} ranks")
    dp, accum = (world, 1) if case.pp == 1 else (world // case.pp, micro)
    if global_batch % (dp * accum):
        raise ConfigError(f"--global-batch {global_batch} is invalid for {case.name} on {world} "
                          f"ranks: it must be a multiple of {dp * accum} ({dp} data-parallel "
                          f"positions x {accum} micro-batches; --micro-batches {micro})")
    return TrainConfig(steps=steps, batch_size=global_batch // (dp * accum), grad_accum=accum,
                       warmup_steps=0, eval_batches=accum, pp=case.pp,
                       pp_schedule=case.schedule, pp_layout=case.layout,
                       pp_overlap=case.overlap)
