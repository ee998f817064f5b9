"""Per-rank memory of one MoE layer under EP / FSSDP, measured from the tensors held
(``moeflow bench hecate``; a HECATE Fig. 13 analog, and the HECATE-RM claim of Section 3.2).

* :func:`state_bytes`: the bytes of the parameters, their gradients and the optimizer's state
  tensors this rank holds (unique storages, ``untyped_storage().nbytes()``, so shared or
  viewed storage counts once).
* :class:`MaterializedProbe`: the bytes of the FSSDP layer's materialized experts (the stacked
  held-expert tensor of :mod:`moeflow.strategies.fssdp.layer_experts`) **still held between the
  forward and the backward**: with HECATE-RM its storage is resized to 0 after the forward and
  refilled by the backward's second spAG, without it the held copies stay for the backward.
  It wraps the layer's ``end`` hook on this one instance (bench instrumentation, no change of
  the layer's computation). EP materializes nothing (its experts compute from their
  parameters), so it reads 0 there.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.strategies.fssdp.layer_experts import FSSDPExperts


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes()) if st.data_ptr() else id(st)
        if key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"params", "grads", "optimizer"}``: bytes of the tensors this rank holds for them."""
    params = list(module.parameters())
    opt = []
    if optimizer is not None:
        for p in params:
            opt += [v for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
    return {"params": _storage_bytes(params),
            "grads": _storage_bytes(p.grad for p in params),
            "optimizer": _storage_bytes(opt)}


class MaterializedProbe:
    """Records the FSSDP layer's materialized tensor at the end of each forward; ``held_bytes()``
    reads how many bytes its storage holds *now* (call it between forward and backward)."""

    def __init__(self, experts: nn.Module):
        self.experts = experts if isinstance(experts, FSSDPExperts) else None
        self._flat: torch.Tensor | None = None
        if self.experts is not None:
            original = self.experts.end

            def end(back, *args, **kwargs):
                current = self.experts._current
                self._flat = None if current is None else current[1]
                return original(back, *args, **kwargs)

            self.experts.end = end              # instance attribute: this layer only

    def held_bytes(self) -> int:
        if self._flat is None:
            return 0
        return self._flat.untyped_storage().nbytes()

    def rows(self) -> int:
        """Experts in the last materialized tensor (held on this rank, owned ones included)."""
        return 0 if self._flat is None else int(self._flat.shape[0])

    def clear(self) -> None:
        self._flat = None


__all__ = ["MaterializedProbe", "state_bytes"]
