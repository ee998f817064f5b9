"""Which GPT blocks each pipeline stage runs: consecutive blocks, as even as the count allows
(the first ``n_layers % n_stages`` stages one block more), the token embedding before the
first stage's blocks and the final norm, the tied head and the loss after the last stage's
(GPipe, Huang et al. 2019 Section 2: a sequence of layers cut into cells)."""

from __future__ import annotations

from moeflow.errors import ConfigError


def stage_blocks(n_layers: int, n_stages: int) -> list[range]:
    """The block indices of each of ``n_stages`` stages (every stage at least one block)."""
    if n_stages > n_layers:
        raise ConfigError(f"--set n_layers={n_layers} is invalid with {n_stages} pipeline "
                          f"stages (--pp x stages per rank): every stage needs at least one "
                          f"block; use --set n_layers={n_stages} or more, or a smaller --pp")
    base, extra = divmod(n_layers, n_stages)
    out, lo = [], 0
    for s in range(n_stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out
