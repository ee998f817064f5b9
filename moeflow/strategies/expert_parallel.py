"""Plain expert parallelism with the ScheMoE exchange (ScheMoE Section 3).

Each EP rank holds ``num_experts / ep_size`` whole experts; the send buffer goes through the
scheduled, chunked encode / all-to-all / decode pipeline (ScheMoE Section 3.2-3.3, Eq. 4-9),
with the shared experts overlapped as the side task S. All hooks are the defaults of
:class:`~moeflow.strategies.base.ExpertStrategy`; this file registers them as ``"ep"``.
"""

from __future__ import annotations

from moeflow.errors import ConfigError
from moeflow.strategies.base import ExpertStrategy, register_strategy


@register_strategy("ep")
class ExpertParallel(ExpertStrategy):
    """Whole experts on their EP rank; capacity padding may be trimmed
    (``MoEConfig.capacity_padding``)."""

    @classmethod
    def check_config(cls, cfg, topo) -> None:
        # Parm's MP / ESP layouts and schedules are a strategy of their own (Parm Section III)
        if topo.mp_size > 1 or topo.esp_size > 1:
            raise ConfigError(
                f"MoEConfig.placement='ep' is invalid with mp_size={topo.mp_size}, "
                f"esp_size={topo.esp_size}: experts sharded over an ESP group or a layer "
                "inside model parallelism is Parm's placement; set placement='parm' (the "
                "CLI's --mp / --esp set it)")
