"""Plain expert parallelism with the ScheMoE exchange (ScheMoE Section 3).

Each EP rank holds ``num_experts / ep_size`` whole experts; the send buffer goes through the
scheduled, chunked encode / all-to-all / decode pipeline (ScheMoE Section 3.2-3.3, Eq. 4-9),
with the shared experts overlapped as the side task S. All hooks are the defaults of
:class:`~moeflow.strategies.base.ExpertStrategy`; this file registers them as ``"ep"``.
"""

from __future__ import annotations

from moeflow.strategies.base import ExpertStrategy, register_strategy


@register_strategy("ep")
class ExpertParallel(ExpertStrategy):
    """Whole experts on their EP rank; capacity padding may be trimmed
    (``MoEConfig.capacity_padding``)."""

