"""The peak bytes of tensor storage alive at once while a piece of code runs, counted from the
tensors it creates (not the process's resident set: no allocator or ``malloc`` effects).

``LiveBytes`` is a ``TorchDispatchMode``: every aten op's outputs are seen (a DTensor by its
local tensor); each new non-meta storage is remembered by a weak reference with its size, and
after every op the sizes of the storages still alive are summed. Storages that existed before
the mode are not counted. Used by tests/multirank/test_fsdp_build.py to check that building the
GPT with FSDP2 never holds the whole dense part on a rank.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.peak = 0              # the most bytes alive at once
        self.largest = 0           # the largest single storage seen

    def _track(self, t) -> None:
        local = getattr(t, "_local_tensor", None)     # a DTensor: its local shard
        t = local if local is not None else t
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return
        st = t.untyped_storage()
        ref = StorageWeakRef(st)
        if ref not in self.live:
            self.live[ref] = st.nbytes()
            self.largest = max(self.largest, st.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        self.live = {r: n for r, n in self.live.items() if not r.expired()}
        self.peak = max(self.peak, sum(self.live.values()))
        return out
