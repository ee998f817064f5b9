"""``moeflow bench bigmac``'s cases: one fine-grained MoE shape as each expert structure (BigMac
Section 3's descend-communicate-communicate-ascend against fine-grained and vanilla experts),
their configs, inputs, routing and all-to-all bytes, shared with ``moeflow simulate bigmac``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.config import MoEConfig
from moeflow.dispatch import capacity
from moeflow.experts.structure import comm_width
from moeflow.routing.choices import router_choices


@dataclass
class StructureCase:
    structure: str
    num_experts: int
    top_k: int
    d_expert: int
    downscale_factor: float | None = None
    capacity_factor: float | None | str = "auto"

    @property
    def name(self) -> str:
        r = f"-r{self.downscale_factor:g}" if self.downscale_factor else ""
        return f"{self.structure}{r}-E{self.num_experts}-top{self.top_k}"


def default_cases(num_experts: int, d_expert: int, top_ks: list[int], r: float,
                  structures: list[str], granularity: int) -> list[StructureCase]:
    """For each k: the fine-grained shape (E, F, k) as each requested structure; ``vanilla``
    is that shape merged by ``granularity`` (E/g experts of width F*g, top k/g)."""
    out = []
    for k in top_ks:
        for s in structures:
            if s == "vanilla":
                out.append(StructureCase(s, num_experts // granularity, max(1, k // granularity),
                                         d_expert * granularity))
            else:
                out.append(StructureCase(s, num_experts, k, d_expert,
                                         r if s == "bigmac" else None))
    return out


def expected_a2a_bytes(cfg: MoEConfig, tokens: int, element_size: int) -> int:
    """Bytes handed to the all-to-all in one forward + backward by a rank with ``tokens``."""
    w = comm_width(cfg)
    rows = (cfg.top_k * tokens if cfg.dropless else
            cfg.num_experts * capacity(tokens, cfg.top_k, cfg.num_experts, cfg.capacity_factor))
    return 4 * rows * w * element_size


def case_config(case: StructureCase, d_model: int) -> MoEConfig:
    """The layer a case times (``counting`` is the direct all-to-all that counts its bytes)."""
    return MoEConfig(d_model=d_model, d_expert=case.d_expert, num_experts=case.num_experts,
                     top_k=case.top_k, structure=case.structure,
                     downscale_factor=case.downscale_factor,
                     capacity_factor=case.capacity_factor, a2a="counting", seed=1,
                     # the byte formula counts capacity's whole E*C buffer
                     capacity_padding="pad")


def case_input(tokens: int, d_model: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input tokens (the same in every repetition)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(tokens, d_model, generator=gen)


def case_routing(case: StructureCase, world: int, tokens: int, d_model: int
                 ) -> list[torch.Tensor]:
    """The ``(tokens, top_k)`` expert ids each rank's router picks in a timed step (the router
    is built from the config alone, reads ``x`` before BigMac's descend, and no step changes
    it): the routing ``moeflow simulate bigmac`` plans, so its bytes are the measured run's."""
    return router_choices(case_config(case, d_model),
                          [case_input(tokens, d_model, p) for p in range(world)])
