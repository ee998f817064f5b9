"""Pipelined chunks of one layer call, computed on the host from the count matrix.

The send buffer is cut into r chunks: each expert's block of ``c_e`` rows contributes rows
``[floor(i c_e / r), floor((i+1) c_e / r))`` to chunk i, so every chunk is a valid all-to-all of
its own and every expert sees a slice of its tokens (ScheMoE section 4, "the input tensor is
uniformly partitioned"). Because every rank knows every rank's counts (``DispatchPlan.counts``),
each chunk's whole split matrix, its receive layout and the regrouping of received rows by
local expert follow here with numpy, without messages or device synchronisation. Index tensors
go to the device once per call (pinned, non-blocking on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeflow.devices import to_device_async
from moeflow.dispatch.plan import DispatchPlan


def chunk_counts(counts: np.ndarray, r: int) -> list[np.ndarray]:
    """Per chunk, the rows each block contributes: ``floor((i+1)c/r) - floor(i c/r)``."""
    edges = [(counts * i) // r for i in range(r + 1)]
    return [edges[i + 1] - edges[i] for i in range(r)]


def block_rows(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[b], starts[b] + sizes[b])`` over blocks b."""
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(sizes) - sizes
    return np.repeat(starts - offsets, sizes) + np.arange(total, dtype=np.int64)


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] = i``: gathering by ``inv`` undoes gathering by ``perm``."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


def to_device(a: np.ndarray, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """Host indices -> ``device`` (from pinned memory, non-blocking, on CUDA)."""
    return to_device_async(np.ascontiguousarray(a), device, dtype)


@dataclass
class Grouping:
    """Received rows (source-major, then local expert) <-> expert-major rows for the experts.

    ``counts[j]``: rows of local expert j. With equal counts per (source, expert) the regroup
    is a transpose done by reshapes (``shape`` set); otherwise a permutation: ``group`` gathers
    rows by ``perm`` and ``ungroup`` gathers them back by its inverse ``inverse`` (a row gather
    both ways, and in both backwards too (:class:`_PermuteRows`); a scatter, ``index_copy`` by
    ``perm`` or ``index_select``'s own backward, is slower on CPU).
    """

    counts: list[int]
    offsets: torch.Tensor | None        # int32 cumulative counts on the device when they
                                        # differ (grouped_mm); None when equal
    shape: tuple[int, int, int] | None  # (ep, E_local, rows per block) for the transpose case
    perm: torch.Tensor | None
    inverse: torch.Tensor | None = None     # inverse[perm[i]] = i

    @classmethod
    def build(cls, recv: np.ndarray, device: torch.device) -> "Grouping":
        ep, e_local = recv.shape
        counts = recv.sum(0).tolist()
        offs = (to_device(np.cumsum(counts), device, torch.int32)
                if len(set(counts)) > 1 else None)
        if e_local == 1 or ep == 1:
            return cls(counts, offs, None, None)
        if (recv == recv.flat[0]).all():
            return cls(counts, offs, (ep, e_local, int(recv.flat[0])), None)
        expert_of_row = np.repeat(np.tile(np.arange(e_local), ep), recv.reshape(-1))
        perm = np.argsort(expert_of_row, kind="stable")
        return cls(counts, offs, None, to_device(perm, device),
                   to_device(inverse_permutation(perm), device))

    def group(self, x: torch.Tensor) -> torch.Tensor:
        if self.shape is not None:
            ep, e, c = self.shape
            return x.view(ep, e, c, x.shape[1]).transpose(0, 1).reshape(-1, x.shape[1])
        return x if self.perm is None else _PermuteRows.apply(x, self.perm, self.inverse)

    def ungroup(self, y: torch.Tensor) -> torch.Tensor:
        if self.shape is not None:
            ep, e, c = self.shape
            return y.view(e, ep, c, y.shape[1]).transpose(0, 1).reshape(-1, y.shape[1])
        return y if self.perm is None else _PermuteRows.apply(y, self.inverse, self.perm)


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm`` whose inverse is ``inverse``: the backward is the
    row gather ``g[inverse]``, not autograd's ``index_add_`` of ``index_select`` (a scatter into
    a zero buffer, a fill and a scatter of every row, in the experts' backward of every
    expert-parallel step with unequal counts)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.inverse = inverse
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, g):
        return g.index_select(0, ctx.inverse), None, None


@dataclass
class ChunkPlan:
    rows: list[torch.Tensor] | None     # send-buffer rows of chunk i (None at r = 1: all)
    matrix: list[list[list[int]]]       # per chunk, the split matrix S[src][dst] (EP group)
    send_splits: list[list[int]]
    recv_splits: list[list[int]]
    groupings: list[Grouping]
    # r > 1: where each send-buffer row lies in the chunks' concatenation (the inverse of
    # cat(rows)), so reassembling the chunks is one row gather; None at r = 1
    assemble: torch.Tensor | None = None

    @classmethod
    def build(cls, plan: DispatchPlan, r: int, device: torch.device) -> "ChunkPlan":
        ep, me, e_local = plan.counts.shape[0], plan.ep_rank, plan.num_local
        parts = chunk_counts(plan.counts, r)
        mats = [c.reshape(ep, ep, e_local).sum(2) for c in parts]
        rows = assemble = None
        if r > 1:
            mine = plan.counts[me]
            starts = np.cumsum(mine) - mine
            host = [block_rows(starts + (mine * i) // r, parts[i][me]) for i in range(r)]
            rows = [to_device(h, device) for h in host]
            # the chunks' rows partition the send buffer's int(mine.sum()) rows
            assemble = to_device(inverse_permutation(np.concatenate(host)), device)
        return cls(rows=rows, assemble=assemble,
                   matrix=[m.tolist() for m in mats],
                   send_splits=[m[me].tolist() for m in mats],
                   recv_splits=[m[:, me].tolist() for m in mats],
                   groupings=[Grouping.build(c[:, me * e_local:(me + 1) * e_local], device)
                              for c in parts])

    def transposed(self, i: int) -> list[list[int]]:
        """Chunk i's split matrix of the way back (combine): ``S^T``."""
        return [list(col) for col in zip(*self.matrix[i])]
