"""Expert capacity (GShard section 2.2, Switch Transformer Eq. 3)."""

from __future__ import annotations

import math


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """``C = ceil(f * k * T / E)``: slots per expert for a local batch of T tokens.

    The product is rounded to 9 decimals before the ceiling, so a factor with a short decimal
    form gives the exact result: 1.25 * 2 * 64 / 8 is 20, not 20.000000000000004 -> 21. Plain
    float arithmetic, so ``torch.compile`` traces it without a graph break.
    """
    return math.ceil(round(factor * top_k * num_tokens / num_experts, 9))
