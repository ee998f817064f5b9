"""Expert capacity (GShard section 2.2, Switch Transformer Eq. 3)."""

from __future__ import annotations

import math


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """``C = ceil(f * k * T / E)``: slots per expert for a local batch of T tokens.

    Computed in exact rational arithmetic where ``factor`` is a float with a short decimal form,
    so 1.25 * 2 * 64 / 8 is 20, not 20.000000000000004 -> 21.
    """
    from fractions import Fraction

    f = Fraction(str(factor)) if isinstance(factor, float) else Fraction(factor)
    return math.ceil(f * top_k * num_tokens / num_experts)
