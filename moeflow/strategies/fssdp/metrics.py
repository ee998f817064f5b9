"""Training metrics of HECATE FSSDP (Section 3): per-rank token loads, the max/mean load ratio
(the straggler effect HECATE removes, Section 2) and the sparse collectives' bytes, summed over
the model's FSSDP layers after a step. Every rank computes the same values (the loads and
``P'`` are known everywhere), so rank 0 can log them without a collective."""

from __future__ import annotations

import numpy as np
from torch import nn

from moeflow.strategies.fssdp.layer_experts import FSSDPExperts


def fssdp_metrics(model: nn.Module) -> dict:
    layers = [m for m in model.modules() if isinstance(m, FSSDPExperts)
              and m.last_loads is not None]
    if not layers:
        return {}
    loads = np.sum([m.last_loads for m in layers], axis=0)
    ratios = [float(m.last_loads.max()) / max(float(m.last_loads.mean()), 1e-12)
              for m in layers]
    stats = [m.stats() for m in layers]
    return {"fssdp_rank_tokens": [int(x) for x in loads],
            "fssdp_max_over_mean": float(loads.max()) / max(float(loads.mean()), 1e-12),
            "fssdp_layer_max_over_mean": float(np.mean(ratios)),
            "spag_bytes": sum(s.get("spag_bytes_all_ranks", 0.0) for s in stats),
            "sprs_bytes": sum(s.get("sprs_bytes_all_ranks", 0.0) for s in stats)}


__all__ = ["fssdp_metrics"]
