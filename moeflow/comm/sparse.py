"""HECATE's sparse collectives (Section 3.1): SparseAllGather and SparseReduceScatter.

A logical buffer is cut into equal chunks ``C`` (under FSSDP one chunk = one expert's flat
parameters, or its gradient); a *chunk placement* ``P ⊆ C x D`` says which ranks hold each chunk.
Here a placement is a sequence indexed by chunk of sets of group ranks.

* ``spAG(P0, P1)``: requires every chunk on exactly one rank in ``P0`` (``P0`` "partitions all
  blocks into disjoint subsets, each assigned to a unique device", i.e. the paper's
  "surjective") and ``P0 ⊆ P1``; afterwards every rank of ``P1[c]`` holds chunk ``c``.
* ``spRS(P0, P1)``: requires every chunk on exactly one rank in ``P1`` and ``P1 ⊆ P0``;
  afterwards the rank of ``P1[c]`` holds the sum of the ``P0`` copies of ``c``.

**Two transports** (``transport=``). ``"p2p"`` (default): batched point-to-point
(``dist.batch_isend_irecv``). ``"broadcast"``: the paper prototype's grouped broadcasts and
reduces (Section 5, "Implementation"): spAG is one ``broadcast`` per replicated chunk from its
owner in the group of its holders, spRS one ``reduce`` per chunk to its owner in the group of
its ``P0`` holders. Such a group is a world collective to create (and an NCCL communicator
each); :class:`~moeflow.comm.holder_groups.HolderGroups` creates each distinct holder set's
group once, on every rank in the same order, and caches it. Every rank issues its broadcasts
(reduces) in ascending chunk order, so the members of any two groups see them in one order.
A reduce's summation order is the backend's, so the broadcast spRS equals the point-to-point
one to rounding (float64 parity in tests/multirank/test_fssdp_transport.py), not bitwise.

Point-to-point: The owner sums the replicas' gradients itself in ascending rank order, so
spRS is deterministic and bitwise equal to a dense reference summed in that order. The price is
that an owner sends (spAG) or receives (spRS) ``|P1[c]| - 1`` copies of its chunk directly
instead of through a pipelined broadcast tree: the total volume is the paper's (Eq. 2 summed over
each group's members, :func:`allreduce_volume`), each rank *receives* at most ``λS`` in spAG and
*sends* at most ``λS`` in spRS (Eq. 1, :func:`sparsity_bound`), but an owner of a chunk with many
replicas is a hot spot on the other side.

Every wait is bounded by the process group's timeout (:func:`group_timeout`): a rank that never
joins makes its peers raise instead of hanging. On CUDA tensors :func:`wait_work` calls
``work.wait()`` without a timeout: ProcessGroupNCCL then only makes the current stream wait for
the collective's stream, while a timeout argument would block the host thread until the GPU
finishes (and so serialise the CPU with every sparse collective); the NCCL watchdog still
aborts a collective that outlives the group's timeout. On CPU (gloo) the timeout is passed.
With ``verify=True`` (default) the ranks first all-gather a digest of the placements, shape and
dtype plus a flag saying their inputs met the pre-condition, so a disagreement or a bad input
raises the same error on every rank.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from moeflow.comm.holder_groups import HolderGroups

ChunkPlacement = Sequence[Iterable[int]]

# torch >= 2.10 names it all_gather_single (all_gather_into_tensor warns there)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

TRANSPORTS = ("p2p", "broadcast")


class SparseCollectiveError(RuntimeError):
    """A sparse collective's pre- or post-condition does not hold (HECATE Section 3.1)."""


# -- placements and volumes (host only) ------------------------------------------------------

def _normalize(p: ChunkPlacement, world: int, name: str) -> tuple[frozenset[int], ...]:
    out = []
    for c, ranks in enumerate(p):
        ranks = frozenset(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)
               or not 0 <= r < world]
        if bad:
            raise SparseCollectiveError(f"{name}[{c}] names ranks {sorted(map(str, bad))} "
                                        f"outside the group of {world}")
        out.append(ranks)
    return tuple(out)


def _check_pair(p0, p1, world: int, single: str) -> tuple[tuple, tuple]:
    p0, p1 = _normalize(p0, world, "P0"), _normalize(p1, world, "P1")
    if len(p0) != len(p1):
        raise SparseCollectiveError(f"P0 has {len(p0)} chunks and P1 {len(p1)}: both "
                                    "placements must cover the same chunks")
    one, many = (p0, p1) if single == "P0" else (p1, p0)
    other = "P1" if single == "P0" else "P0"
    for c in range(len(p0)):
        if len(one[c]) != 1:
            raise SparseCollectiveError(
                f"{single}[{c}]={sorted(one[c])}: {single} must place every chunk on exactly "
                "one rank (HECATE Section 3.1: the sharded placement partitions the chunks)")
        if not one[c] <= many[c]:
            raise SparseCollectiveError(
                f"{single}[{c}]={sorted(one[c])} is not in {other}[{c}]={sorted(many[c])}: "
                f"the collective requires {single} ⊆ {other} (HECATE Section 3.1)")
    return p0, p1


def spag_send_bytes(p0: ChunkPlacement, p1: ChunkPlacement, chunk_bytes: int,
                    world: int) -> list[int]:
    """Bytes each rank sends in ``spAG(P0, P1)``: the owner sends a copy to every new holder."""
    p0, p1 = _check_pair(p0, p1, world, "P0")
    out = [0] * world
    for c in range(len(p0)):
        (owner,) = p0[c]
        out[owner] += (len(p1[c]) - 1) * chunk_bytes
    return out


def sprs_send_bytes(p0: ChunkPlacement, p1: ChunkPlacement, chunk_bytes: int,
                    world: int) -> list[int]:
    """Bytes each rank sends in ``spRS(P0, P1)``: every replica holder sends its copy once."""
    p0, p1 = _check_pair(p0, p1, world, "P1")
    out = [0] * world
    for c in range(len(p0)):
        for r in p0[c] - p1[c]:
            out[r] += chunk_bytes
    return out


def sparsity_bound(holders: ChunkPlacement, chunk_bytes: int) -> int:
    """Eq. 1's ``λS = |Ĉ| · S/|C|``: the bytes of the chunks that cross devices at all."""
    return sum(chunk_bytes for ranks in holders if len(frozenset(ranks)) > 1)


def allreduce_volume(holders: ChunkPlacement, chunk_bytes: int) -> float:
    """Eq. 2 as printed: ``Σ_i 2(|D_i| - 1)/|D_i| · S/|C|`` over replicated chunks.

    Each term is what one member of the data-parallel group ``D_i`` sends in a ring
    all-reduce of the chunk; the group's total traffic is ``|D_i|`` times that.
    """
    return sum(2 * (len(d) - 1) / len(d) * chunk_bytes
               for d in map(frozenset, holders) if len(d) > 1)


# -- the collectives ---------------------------------------------------------------------------

def group_timeout(group=None) -> datetime.timedelta:
    """The timeout the process group was created with (c10d's default if it cannot be read)."""
    group = group if group is not None else dist.group.WORLD
    for device in getattr(group, "_device_types", [torch.device("cpu")]):
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    from torch.distributed.distributed_c10d import default_pg_timeout
    return default_pg_timeout


def wait_work(work, timeout: datetime.timedelta, device: torch.device | str) -> None:
    """Wait for an asynchronous collective on tensors living on ``device``.

    CUDA: ``work.wait()``, a stream wait; the host is not blocked, and ProcessGroupNCCL's
    watchdog enforces the group's timeout. Elsewhere (gloo): ``work.wait(timeout)`` bounds the
    host's wait directly.
    """
    if torch.device(device).type == "cuda":
        work.wait()
    else:
        work.wait(timeout)


class _Sparse:
    kind = ""

    def __init__(self, p0: ChunkPlacement, p1: ChunkPlacement, shape, dtype: torch.dtype, *,
                 group=None, device: torch.device | str = "cpu", verify: bool = True,
                 transport: str = "p2p", groups: HolderGroups | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"{self.kind}: transport={transport!r} is invalid: choose one of "
                             f"{', '.join(TRANSPORTS)}")
        self.group = group
        self.transport = transport
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.p0, self.p1 = _check_pair(p0, p1, self.world, self.single)
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.verify = verify
        self.chunk_bytes = self.shape.numel() * torch.empty((), dtype=dtype).element_size()
        self.timeout = group_timeout(group)
        self.inputs = sorted(c for c, ranks in enumerate(self.p0) if self.rank in ranks)
        self.outputs = sorted(c for c, ranks in enumerate(self.p1) if self.rank in ranks)
        self.sends, self.recvs = self._plan()           # [(chunk, peer)], ascending
        self.groups = None
        if transport == "broadcast":     # collective: every rank creates the missing groups
            self.groups = groups if groups is not None else HolderGroups(group, self.timeout)
            self.groups.ensure(self._many)
        self.send_bytes = len(self.sends) * self.chunk_bytes
        self.recv_bytes = len(self.recvs) * self.chunk_bytes

    @property
    def _many(self) -> tuple:
        """The placement with several holders per chunk: the groups' holder sets."""
        return self.p1 if self.single == "P0" else self.p0

    def _grouped(self) -> list[tuple[int, int, object]]:
        """``(chunk, owner's global rank, group)`` of the replicated chunks this rank holds,
        in ascending chunk order (one order on every rank: no cross-group deadlock)."""
        one = self.p0 if self.single == "P0" else self.p1
        return [(c, self.groups.global_rank(next(iter(one[c]))), self.groups.get(ranks))
                for c, ranks in enumerate(self._many) if len(ranks) > 1 and self.rank in ranks]

    def _wait_all(self, works) -> None:
        for work in works:
            wait_work(work, self.timeout, self.device)

    # pre-condition on this rank's tensors; an error message, or None
    def _check_inputs(self, chunks: dict) -> str | None:
        if sorted(chunks) != self.inputs:
            return (f"rank {self.rank} passed chunks {sorted(chunks)} but P0 places "
                    f"{self.inputs} on it")
        for c, t in chunks.items():
            if not isinstance(t, torch.Tensor) or t.shape != self.shape \
                    or t.dtype != self.dtype or t.device != self.device:
                desc = (f"{tuple(t.shape)} {t.dtype} on {t.device}"
                        if isinstance(t, torch.Tensor) else type(t).__name__)
                return (f"rank {self.rank} chunk {c} is {desc}; the collective was built for "
                        f"{tuple(self.shape)} {self.dtype} on {self.device}")
        return None

    def _agree(self, problem: str | None) -> None:
        text = repr((self.kind, self.p0, self.p1, tuple(self.shape), str(self.dtype)))
        digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")
        mine = torch.tensor([digest, problem is not None], dtype=torch.int64, device=self.device)
        every = mine.new_empty(self.world * 2)
        work = _all_gather(every, mine, group=self.group, async_op=True)
        wait_work(work, self.timeout, self.device)
        every = every.view(self.world, 2).tolist()
        if problem is not None:
            raise SparseCollectiveError(f"{self.kind} pre-condition: {problem}")
        bad = [r for r, (_, flag) in enumerate(every) if flag]
        if bad:
            raise SparseCollectiveError(f"{self.kind} pre-condition failed on ranks {bad} "
                                        "(their own errors say why)")
        differ = [r for r, (d, _) in enumerate(every) if d != digest]
        if differ:
            raise SparseCollectiveError(f"{self.kind}: ranks {differ} called it with other "
                                        "placements, shape or dtype than rank "
                                        f"{self.rank}; every rank must pass the same ones")

    def _exchange(self, send: list[tuple[int, int, torch.Tensor]],
                  recv: list[tuple[int, int, torch.Tensor]]) -> None:
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=peer, tag=c)
               for c, peer, t in send]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=peer, tag=c)
                for c, peer, t in recv]
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            wait_work(work, self.timeout, self.device)

    def __call__(self, chunks: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        problem = self._check_inputs(chunks)
        if self.verify:
            self._agree(problem)
        elif problem is not None:
            raise SparseCollectiveError(f"{self.kind} pre-condition: {problem}")
        out = self._run(chunks)
        if sorted(out) != self.outputs:                  # post-condition (Section 3.1)
            raise SparseCollectiveError(f"{self.kind} post-condition: rank {self.rank} ends "
                                        f"with chunks {sorted(out)}, P1 places "
                                        f"{self.outputs} on it")
        return out


class SparseAllGather(_Sparse):
    """``spAG(P0, P1)``: ``chunks`` = this rank's ``P0`` chunks -> its ``P1`` chunks.

    The returned dict holds the input tensors themselves for the chunks this rank owned and
    new tensors for the ones it received. ``send_bytes`` / ``recv_bytes``: this rank's volume.
    """

    kind = "SparseAllGather"
    single = "P0"

    def _plan(self):
        sends = [(c, d) for c in self.inputs for d in sorted(self.p1[c] - {self.rank})]
        recvs = [(c, next(iter(self.p0[c]))) for c in self.outputs if c not in self.inputs]
        return sends, recvs

    def _run(self, chunks):
        if self.transport == "broadcast":
            return self._run_broadcast(chunks)
        out = dict(chunks)
        recv = []
        for c, src in self.recvs:
            out[c] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            recv.append((c, src, out[c]))
        self._exchange([(c, d, chunks[c].contiguous()) for c, d in self.sends], recv)
        return out

    def _run_broadcast(self, chunks):
        out = dict(chunks)
        works = []
        for c, src, group in self._grouped():
            if c in chunks:                   # the owner: broadcast its own tensor
                out[c] = chunks[c].contiguous()
            else:
                out[c] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            works.append(dist.broadcast(out[c], src=src, group=group, async_op=True))
        self._wait_all(works)
        return out


class SparseReduceScatter(_Sparse):
    """``spRS(P0, P1)``: ``chunks`` = this rank's ``P0`` copies -> the sums of its ``P1`` chunks.

    The sum of chunk ``c`` adds the ``P0`` holders' copies in ascending rank order (a chunk held
    once is returned as is). ``send_bytes`` / ``recv_bytes``: this rank's volume.
    """

    kind = "SparseReduceScatter"
    single = "P1"

    def _plan(self):
        sends = [(c, next(iter(self.p1[c]))) for c in self.inputs if c not in self.outputs]
        recvs = [(c, s) for c in self.outputs for s in sorted(self.p0[c] - {self.rank})]
        return sends, recvs

    def _run(self, chunks):
        if self.transport == "broadcast":
            return self._run_reduce(chunks)
        got = {}
        recv = []
        for c, src in self.recvs:
            got[c, src] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            recv.append((c, src, got[c, src]))
        self._exchange([(c, d, chunks[c].contiguous()) for c, d in self.sends], recv)
        out = {}
        for c in self.outputs:
            parts = [chunks[c] if s == self.rank else got[c, s] for s in sorted(self.p0[c])]
            if len(parts) == 1:
                out[c] = parts[0]
                continue
            acc = parts[0].clone()
            for part in parts[1:]:
                acc += part
            out[c] = acc
        return out

    def _run_reduce(self, chunks):
        out, works = {}, []
        for c, dst, group in self._grouped():
            # a copy: the backend may use a non-root's buffer as scratch, and the root's
            # result must not overwrite the caller's tensor
            buf = chunks[c].clone(memory_format=torch.contiguous_format)
            works.append(dist.reduce(buf, dst=dst, op=dist.ReduceOp.SUM, group=group,
                                     async_op=True))
            if c in self.outputs:
                out[c] = buf
        self._wait_all(works)
        for c in self.outputs:               # chunks held by their owner only
            out.setdefault(c, chunks[c])
        return out


__all__ = ["TRANSPORTS", "SparseAllGather", "SparseReduceScatter", "SparseCollectiveError",
           "allreduce_volume", "group_timeout", "wait_work", "sparsity_bound", "spag_send_bytes",
           "sprs_send_bytes"]
