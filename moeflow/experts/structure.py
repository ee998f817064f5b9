"""MoE structures: vanilla, fine-grained (CDAC) and BigMac (DCCA).

BigMac (``papers/bigmac.txt``, Fig. 2 and Eq. 2-4; the symbols lost from the text are in
docs/design.md, "Notes on the papers"):

* ``vanilla`` (Fig. 2a): few large experts ``E(h) = W2 act(W1 h)``, ``W1: M -> F``.
* ``fine_grained`` (Fig. 2b, DeepSeekMoE): many small experts of the same form; the all-to-all
  carries tokens at ``d_model = M`` and each expert descends then ascends
  (communicate-descend-ascend-communicate, CDAC). Computationally it is ``vanilla`` with other
  sizes; the two differ by their defaults (dropless routing here) and by the shape they stand
  for in ``moeflow model-info``.
* ``bigmac`` (Fig. 2c, DCCA): ``z = x W_d`` (``M -> rM``) *before* the dispatch all-to-all,
  experts with reversed projections ``E(z) = W_down act(W_up z)`` (``W_up: rM -> F/r``,
  ``W_down: F/r -> rM``: the same parameter count and FLOPs as a fine-grained expert), and
  ``y = (sum_i g_i E_i(z)) W_u`` (``rM -> M``) *after* the combine all-to-all. The router reads
  ``x``, the vector before descending (the paper's choice). Both all-to-alls carry ``rM``
  columns instead of ``M``: the volume falls by ``r``.

The experts stay :class:`~moeflow.experts.ffn.ExpertFFN` with ``d_model`` replaced by the
communicated width and ``d_hidden`` by ``F/r``, so grouped compute, expert-parallel placement,
per-global-expert checkpoints and gradient sync are unchanged. ``W_d`` and ``W_u`` are
replicated (not expert) parameters, initialised from ``(seed, layer_id, name)`` only, so the
layer is the same function on any number of ranks.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeflow.config import MoEConfig
from moeflow.init import seeded_normal


def comm_width(cfg: MoEConfig) -> int:
    """Columns each routed token carries through the all-to-all (``r*M`` for BigMac)."""
    return round(cfg.downscale * cfg.d_model)


def expert_hidden(cfg: MoEConfig) -> int:
    """Hidden width of one expert (``F/r`` for BigMac, ``F = d_expert`` otherwise)."""
    return round(cfg.d_expert / cfg.downscale)


class DCCAProjections(nn.Module):
    """BigMac's descending ``W_d: (M, rM)`` and ascending ``W_u: (rM, M)`` projections.

    Initialised ``N(0, 1/fan_in)`` from ``(seed, "layer", layer_id, "descend"|"ascend")``; both
    are replicated over every rank (their gradients are averaged by ``sync_gradients``).
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        m, w = cfg.d_model, comm_width(cfg)
        self.descend = nn.Parameter(seeded_normal((m, w), 1.0 / math.sqrt(m), cfg.seed,
                                                  "layer", cfg.layer_id, "descend"))
        self.ascend = nn.Parameter(seeded_normal((w, m), 1.0 / math.sqrt(w), cfg.seed,
                                                 "layer", cfg.layer_id, "ascend"))

    def extra_repr(self) -> str:
        return f"{self.descend.shape[0]} -> {self.descend.shape[1]} -> {self.ascend.shape[1]}"

    def down(self, x: torch.Tensor) -> torch.Tensor:
        """Step 3 of docs/design.md, "The path of a token": ``z = x W_d``."""
        return x @ self.descend.to(x.dtype)

    def up(self, y: torch.Tensor) -> torch.Tensor:
        """Step 7 (ascend): ``y W_u``."""
        return y @ self.ascend.to(y.dtype)


def build_projections(cfg: MoEConfig) -> DCCAProjections | None:
    """The DCCA projections for ``bigmac``; None for the structures that communicate at M."""
    return DCCAProjections(cfg) if cfg.structure == "bigmac" else None
