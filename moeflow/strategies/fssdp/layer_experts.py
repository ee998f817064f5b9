"""FSSDP inside the MoE layer: owner-only expert storage, spAG before the forward, spRS from the
backward, and re-materialization (HECATE Sections 3.2 and 4.4; ``MoEConfig(placement="fssdp")``).

*Sharding phase* (Section 3.2): each expert's parameters live on its owner only. A rank's owned
experts are the rows of one ``nn.Parameter`` ``slots: (S, numel)`` (an expert's row = its named
tensors ``w1, [w3], w2, [b1, b3, b2]`` flattened, as :class:`~moeflow.experts.ExpertFFN`
names and initialises them from the expert's global id), so a ``torch.optim`` optimizer over
``model.parameters()`` holds exactly one copy of every expert and of its state globally. The
initial shard map is the trivial one (Section 3.2: contiguous equal blocks), so ``S = E / world``
on every rank. In the GPT all FSSDP layers share one slot tensor per rank
(:func:`moeflow.strategies.fssdp.reshard.share_slots`), whose row count stays fixed when Algorithm 2
re-shards (a layer may then own any number of experts on a rank).

*Materialization phase*, per iteration (Section 3.2):

1. ``P'`` is chosen (``FSSDPOptions.materialize``) and ``spAG(P, P')`` (Section 3.1) brings this
   rank every expert it holds. :meth:`FSSDPExperts.prefetch` launches it on the layer's
   communication lane, so the GPT block can start it before its attention (Fig. 1c); otherwise
   the forward runs it in place. Waits are bounded by the group's timeout.
2. :class:`_Gather` stacks the held experts into one tensor ``(H, numel)`` (owned rows copied
   from ``slots``, replicas received); the layer's experts compute with views of it. Its
   backward is ``spRS(P', P)``: each owner gets the sum of every copy's gradient (its own
   included, in ascending rank order) into ``slots.grad`` -- the "gradient hook" that runs
   inside autograd as soon as the layer's expert gradients exist.
3. With ``rematerialize=True`` (HECATE-RM, Section 3.2: "SparseAllGather is launched twice for
   an MoE layer in each iteration") the stacked tensor's storage is freed after the forward and
   refilled by a second spAG when the backward reaches the layer (:class:`_Regather`), as FSDP
   frees and re-gathers its flat parameters; with ``overlap_regather`` that second spAG is
   launched on a lane earlier in the backward, under the next block's attention backward
   (:mod:`moeflow.strategies.fssdp.regather`). Under autocast the stacked tensor is in the
   autocast dtype (:meth:`FSSDPExperts._held_dtype`): what the backward reads is then that
   tensor, which the free releases, not autocast's own copies of fp32 weights.

Token routing over ``P'`` is :mod:`moeflow.strategies.fssdp.token_plan`.

Under activation checkpointing (``torch.utils.checkpoint``, :mod:`moeflow.plan_record`) the
first forward plans as above, once per step: ``P'`` chosen, the counts exchanged, the load
window entered. The recomputation in backward (:meth:`FSSDPExperts.replay_begin`,
:meth:`FSSDPExperts.replay_plan`) re-gathers the experts of the recorded ``P'`` with one spAG
and reuses the recorded plan: no other ``P'``, no count exchange, no second window entry. That
spAG is HECATE-RM's second one (Section 3.2), moved to where the checkpoint recomputes, so a
checkpointed forward neither frees its held experts nor schedules :class:`_Regather`.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future

import numpy as np
import torch
from torch import nn

from moeflow.comm.holder_groups import shared_holder_groups
from moeflow.comm.sparse import (SparseAllGather, SparseReduceScatter, group_timeout,
                                 spag_send_bytes, sprs_send_bytes)
from moeflow.strategies.fssdp.transport import broadcast_candidate, time_transports
from moeflow.errors import ConfigError
from moeflow.experts.activations import build_activation
from moeflow.experts.ffn import EXPERT_PARAM_ATTR, ExpertFFN
from moeflow.strategies.fssdp.optimizers import mark_slots
from moeflow.strategies.fssdp.materialize import (LoadWindow, algorithm1_branch, calibrate,
                                           link_bandwidth, overlap_degree, sparse_materialize)
from moeflow.strategies.fssdp.memory import capacity_from_budget, free_at_start, free_bytes
from moeflow.strategies.fssdp.options import FSSDPOptions
from moeflow.strategies.fssdp.placement import Placement
from moeflow.strategies.fssdp import regather
from moeflow.strategies.fssdp.intervals import LazyInterval
from moeflow.strategies.fssdp.token_plan import KeptChoices, fssdp_plan
from moeflow.schedule.streams import Clock, CommLane, Handoff
from moeflow.schedule.tasks import Task

SPAG = "spAG"       # the early spAG's task kind in a Timeline


class HeldFFN(ExpertFFN):
    """:class:`ExpertFFN`'s computation over the experts a rank holds this iteration: its
    weights are views of the materialized tensor, bound per call (:meth:`bind`), not
    parameters; ``parameters()`` returns them, so the scheduled exchange differentiates the
    expert computation with respect to them (:mod:`moeflow.schedule.pipeline`). It computes
    ``H`` experts for ``slots >= H`` held slots (the trailing ones get no rows)."""

    def __init__(self, activation: str, bias: bool, d_out: int,
                 activation_options: dict | None = None):
        nn.Module.__init__(self)
        self.act = build_activation(activation, activation_options)
        self.activation, self.has_bias, self.d_out = self.act.name, bias, d_out
        self.shard, self.reduce, self.first_expert = (0, 1), None, 0
        self.num_local, self._weights, self.names = 0, [], []

    def bind(self, weights: dict[str, torch.Tensor]) -> "HeldFFN":
        for name in self.names:          # drop the last call's views (they keep its storage)
            object.__setattr__(self, name, None)
        for name, w in weights.items():
            object.__setattr__(self, name, w)
        if weights:
            self.names = list(weights)
        self._weights = list(weights.values())
        self.num_local = self._weights[0].shape[0] if self._weights else 0
        return self

    def parameters(self, recurse: bool = True):
        return iter(self._weights)

    def bound_to(self, weights: list[torch.Tensor]) -> "HeldFFN":
        """A copy computing with ``weights`` (one call's held experts, in :meth:`bind`'s
        order): the scheduled exchange recomputes a checkpointed call's experts with it in
        backward, after the layer has unbound its own (:mod:`moeflow.schedule.pipeline`)."""
        other = object.__new__(HeldFFN)
        other.__dict__.update(self.__dict__)
        return other.bind(dict(zip(self.names, weights)))

    def forward(self, x: torch.Tensor, counts: list[int],
                offsets: torch.Tensor | None = None) -> torch.Tensor:
        H = self.num_local
        if any(counts[H:]):
            raise RuntimeError(f"HeldFFN: rows for held slots {list(counts)} beyond the {H} "
                               "experts this rank holds (the dispatch plan is inconsistent)")
        if H == 0:
            return x.new_zeros((x.shape[0], self.d_out))
        counts = list(counts[:H])
        w = self._weights[0].dtype
        if x.dtype != w and torch.is_autocast_enabled(x.device.type) \
                and torch.get_autocast_dtype(x.device.type) == w:
            # held experts materialized in the autocast dtype (HECATE-RM, FSSDPExperts.
            # _held_dtype): the rows go to it too, as autocast would cast them for every matmul,
            # so ExpertFFN's x-dtype cast of the weights does not make fp32 copies of them
            x = x.to(w)
        return super().forward(x, counts, None if offsets is None else offsets[:H])


def _spag_op(p0: Placement, p1: Placement, numel: int, dtype, device, group,
             transport: str = "p2p", groups=None) -> SparseAllGather:
    """``spAG(P, P')`` built (with the broadcast transport: its holder sets' groups created,
    a world collective, so on the caller's thread)."""
    return SparseAllGather(p0.owner_chunks(), p1.holder_chunks(), (numel,), dtype, group=group,
                           device=device, verify=False, transport=transport, groups=groups)


def _run_spag(op: SparseAllGather, p0: Placement, rank: int, owned: dict[int, torch.Tensor]):
    """Run a built spAG on the owned rows; returns (received replicas, (send, recv) bytes)."""
    got = op(owned)
    return {e: t for e, t in got.items() if p0.owners[e] != rank}, (op.send_bytes, op.recv_bytes)


class _Gather(torch.autograd.Function):
    """``slots (S, numel)`` -> held experts ``(H, numel)``; backward = ``spRS(P', P)``."""

    @staticmethod
    def forward(ctx, slots, store, placement, received, dtype=None):
        held = placement.held(store.rank)
        out = slots.new_empty((len(held), slots.shape[1]), dtype=dtype or slots.dtype)
        for i, e in enumerate(held):
            out[i].copy_(slots[store.slot_index[e]] if e in store.slot_index else received[e])
        ctx.store, ctx.placement, ctx.held = store, placement, held
        return out

    @staticmethod
    def backward(ctx, grad):
        store, placement = ctx.store, ctx.placement
        # held experts materialized in the autocast dtype: their gradients are summed over the
        # replicas in the parameters' dtype, as autocast's cast-backward would have given them
        grad = grad.to(store.slots.dtype).contiguous()
        chunks = {e: grad[i] for i, e in enumerate(ctx.held)}
        if store.world > 1:
            transport, groups = store.transport_for(placement)
            lane = store.lane if store.options.overlap_backward else None
            op = SparseReduceScatter(placement.holder_chunks(), store.owners.owner_chunks(),
                                     (store.numel,), grad.dtype,
                                     group=store.group if lane is None else store.lane_group,
                                     device=grad.device, verify=False, transport=transport,
                                     groups=groups)
            if lane is not None:        # on the lane: the attention backward runs meanwhile
                store.launch_sprs(op, chunks, lane)
                return None, None, None, None, None
            chunks = op(chunks)
            store.bytes["sprs"] = (op.send_bytes, op.recv_bytes)
        out = grad.new_zeros(store.slots.shape)     # the slot tensor may hold other layers
        for e, i in store.slot_index.items():
            out[i] = chunks[e]
        return out, None, None, None, None


# spRS launched on a lane by ``overlap_backward`` and not yet added to the owners' gradients:
# (store, op, future, handoff), in launch order. Drained (:func:`drain_backward`) by the next
# FSSDP layer's backward before its first collective, and at the end of the backward.
_BACKWARD_PENDING: list[tuple] = []


def drain_backward() -> None:
    """Wait for every spRS in flight and add the owners' rows to the slots' gradients."""
    while _BACKWARD_PENDING:
        store, op, future, hand = _BACKWARD_PENDING.pop(0)
        store.finish_sprs(op, future, hand)


class _DrainBackward(torch.autograd.Function):
    """Identity at the layer's output; its backward (the layer's first) waits for the spRS of
    the layers after it (``overlap_backward``): one collective in flight from another thread
    at a time, as the early spAG (docs/design.md, one collective order per rank)."""

    @staticmethod
    def forward(ctx, back):
        return back.view_as(back)

    @staticmethod
    def backward(ctx, grad):
        drain_backward()
        return grad


class _Regather(torch.autograd.Function):
    """Identity on the layer's returned rows; its backward (run before the experts' backward)
    refills the freed materialized tensor with a second spAG (HECATE-RM), or with the one
    ``overlap_regather`` launched earlier (:mod:`moeflow.strategies.fssdp.regather`)."""

    @staticmethod
    def forward(ctx, back, store, ticket):
        # the ticket (its flat tensor) comes in a list: autograd must not see it as an input
        ctx.store, ctx.ticket = store, ticket[0]
        return back.view_as(back)

    @staticmethod
    def backward(ctx, grad):
        ctx.store.refill(ctx.ticket)
        ctx.ticket = None
        return grad, None, None


class FSSDPExperts(nn.Module):
    """One layer's experts under FSSDP on ``group`` (the world: FSSDP shards over every rank).

    ``d_in``: the width the experts read and write (``comm_width``); ``d_hidden``: their
    hidden width. Initial values are :class:`ExpertFFN`'s for the same global ids, so FSSDP,
    EP and one process compute the same function.
    """

    def __init__(self, d_in: int, d_hidden: int, num_experts: int, activation: str, seed: int,
                 layer_id: int, bias: bool, options: FSSDPOptions, *, rank: int, world: int,
                 local_size: int, group, activation_options: dict | None = None,
                 lane_group=None):
        super().__init__()
        if num_experts % world:
            raise ConfigError(f"MoEConfig.num_experts={num_experts} is invalid with "
                              f"placement='fssdp' on {world} ranks: the initial (even) sharding "
                              f"needs a multiple of {world}; use "
                              f"{-(-num_experts // world) * world} experts")
        self.options, self.rank, self.world, self.d_in = options, rank, world, d_in
        self.local_size, self.group = local_size, group
        # the early spAG's group: its batched point-to-point runs on the lane thread while
        # the caller's thread runs the block's attention, and a batch's coalescing state
        # belongs to its process group, so it gets a world group of its own (the topology's
        # lane_group: only moeflow's exchanges use it, none while this spAG is in flight)
        self.lane_group = group if lane_group is None else lane_group
        self.num_experts = num_experts
        self.owners = Placement.even(num_experts, world)
        rows, shapes = [], None
        for e in self.owners.owned(rank):
            one = ExpertFFN(d_in, d_hidden, e, 1, activation, seed, layer_id, bias=bias,
                            activation_options=activation_options)
            named = list(one.named_parameters())
            shapes = {n: tuple(p.shape[1:]) for n, p in named}
            rows.append(torch.cat([p.detach().reshape(-1) for _, p in named]))
        self.shapes = shapes
        self.numel = sum(math.prod(s) for s in shapes.values())
        self.slots = nn.Parameter(torch.stack(rows))
        setattr(self.slots, EXPERT_PARAM_ATTR, True)
        mark_slots(self.slots)          # refuse optimizers that are not elementwise
        self.slot_index = {e: i for i, e in enumerate(self.owners.owned(rank))}
        self.__dict__["held"] = HeldFFN(activation, bias, d_in, activation_options)
        self.holders: list | None = None           # P' for materialize="manual"
        self.bytes: dict[str, tuple[int, int]] = {}
        self.last_loads: np.ndarray | None = None   # tokens each rank computed, last forward
        self._pending: tuple | None = None
        self._current: tuple | None = None
        # Algorithm 1's inputs (Section 4.2): load window, t from measured times and bw, m
        self.window = LoadWindow(num_experts, options.window)
        self.bandwidth = options.bandwidth_Bps
        if options.materialize == "sparse" and options.overlap_degree is None \
                and self.bandwidth is None:
            self.bandwidth = link_bandwidth(options.links, world // local_size > 1)
        # m: the option, or from a memory budget (agreed in each count exchange: None until
        # the first one, when Algorithm 1 has no loads yet), or the number of owned experts
        self.budgeted = (options.memory_budget_bytes is not None
                         or options.memory_budget_fraction is not None)
        self.memory_capacity = (options.memory_capacity if options.memory_capacity is not None
                                else None if self.budgeted else len(self.slot_index))
        self.memory_free: int | None = None  # this rank's free memory at start (budgets)
        self.last_branch: str | None = None  # Algorithm 1's branch for the last sparse P'
        self.non_moe = LazyInterval()       # block start (prefetch) -> layer start
        self.expert_phase = LazyInterval()  # the exchange + experts of the forward
        self.non_moe_s = 0.0                # the ranks' mean of the last measurements
        self.token_s = 0.0                  # expert-phase seconds per token (ranks' mean)
        self.last_t: int | None = None
        self.calibrated = 0                 # forwards whose calibration changed P'
        # spAG / spRS transport (FSSDPOptions.transport); "auto" decides on the first P' that
        # replicates an expert (:meth:`_choose_transport`)
        self.transport = None if options.transport == "auto" else options.transport
        self.transport_ms: tuple[float, float] | None = None    # auto's (p2p, broadcast)
        self.transport_reason: str | None = None   # why auto kept p2p without timing
        self.lane: CommLane | None = None   # the layer's lane (begin), for overlap_backward
        self.sprs_on_lane = 0               # spRS run on the lane so far (overlap_backward)
        self.regather_on_lane = 0           # re-gathers launched early (overlap_regather)
        # host seconds the last backward's refill spent on its spAG: running it, or waiting
        # for the one launched early (the re-gather's exposed time; benchmarks read it)
        self.regather_exposed_s: float | None = None
        self.last_ticket: regather.RegatherTicket | None = None   # the last forward's (RM)
        self.holder_groups = None
        if options.transport != "p2p" and world > 1:
            self.holder_groups = shared_holder_groups(group, group_timeout(group))

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, owned={sorted(self.slot_index)}, "
                f"materialize={self.options.materialize}, "
                f"rematerialize={self.options.rematerialize}")

    # -- P' ---------------------------------------------------------------------------------
    def set_holders(self, holders) -> None:
        """``P'`` for the next iterations (``materialize="manual"``): ``holders[e]`` the ranks
        holding expert ``e``; must contain its owner (checked by :class:`Placement`)."""
        self.holders = [frozenset(h) for h in self.owners.materialize(holders).holders]

    def _row_bytes(self) -> int:
        """Bytes of one token row in the all-to-alls: ``d_in`` values at the autocast dtype
        when autocast is on (the tokens' precision), else at the experts' parameter dtype."""
        dev = self.slots.device.type
        dtype = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                 else self.slots.dtype)
        return self.d_in * dtype.itemsize

    @property
    def expert_bytes(self) -> int:
        return self.numel * self.slots.element_size()

    def overlap(self) -> int:
        """``t`` of Algorithm 1: the option, or ``T_non-MoE * bw / expert_size``."""
        if self.options.overlap_degree is not None:
            return self.options.overlap_degree
        return overlap_degree(self.non_moe_s, self.bandwidth, self.expert_bytes)

    def next_placement(self) -> Placement:
        mode = self.options.materialize
        if mode == "manual" and self.holders is not None:
            return self.owners.materialize(self.holders)
        if mode == "manual":
            raise ConfigError("MoEConfig.fssdp.materialize='manual' needs holders: call "
                              "layer.experts.set_holders(...) before the forward")
        loads = self.window.estimate()
        if mode == "static" or loads is None:
            return self.owners                          # P' = P
        self.last_t = self.overlap()
        # a budget not yet measured (e.g. right after a checkpoint load): no extra memory
        m = 0 if self.memory_capacity is None else self.memory_capacity
        self.last_branch = algorithm1_branch(self.last_t, m, self.num_experts)
        return sparse_materialize(self.owners, loads, self.last_t, m,
                                  self.local_size)      # Algorithm 1

    # -- spAG -------------------------------------------------------------------------------
    def _owned_rows(self) -> dict[int, torch.Tensor]:
        rows = self.slots.detach()
        return {e: rows[i] for e, i in self.slot_index.items()}

    def prefetch(self, lane: CommLane, timeline=None) -> None:
        """Launch this iteration's ``spAG(P, P')`` on the layer's communication lane (Fig. 1c:
        before the block's attention). The forward waits for it, bounded by the group's
        timeout. A second call before that forward does nothing.

        Until :meth:`begin` has waited for it, this rank must issue no other collective from
        another thread (NCCL's one order per rank, docs/design.md): the GPT block runs only
        its attention in between, which has none (FSSDP refuses tensor parallelism).
        ``timeline`` (a :class:`~moeflow.schedule.executor.Timeline`; benchmarks pass one):
        record the spAG as a ``comm`` task ``SPAG`` of the forward (its lane's clock)."""
        if self._pending is not None:
            return
        self.non_moe.start(self.slots.device)     # T_non-MoE of Algorithm 1, every world size
        if self.world == 1:
            return
        placement = self.next_placement()
        dev = self.slots.device
        hand = Handoff(lane, dev)
        ready = hand.ready()
        owned = self._owned_rows()
        op = self._spag(placement, self.lane_group)     # groups created here, not on the lane

        clock = Clock(dev)

        def task():
            hand.enter(ready, list(owned.values()))
            t0 = clock.stamp()
            got = _run_spag(op, self.owners, self.rank, owned)
            if timeline is not None:
                timeline.add(Task(SPAG, 0), "forward", "comm", t0, clock.stamp(),
                             got[1][0] + got[1][1])
            return got, hand.leave()

        self._pending = (placement, lane.submit(task, dev), hand)

    def transport_for(self, placement: Placement) -> tuple[str, object]:
        """(transport, holder groups) of spAG / spRS over ``placement``; with ``"auto"``, the
        first placement that replicates an expert decides (collective: every rank has the
        same ``P'``, so every rank reaches the decision together)."""
        if self.transport is None and any(len(h) > 1 for h in placement.holders):
            self._choose_transport(placement)
        if (self.options.transport == "auto" and self.transport == "broadcast"
                and not self.holder_groups.fits(placement.holders)):
            # a later P' (new manual holders) would pass the cache's bound: p2p from now on,
            # on every rank alike (the same P', the same cache)
            self.transport, self.transport_reason = "p2p", "holder sets past max_groups"
        transport = self.transport or "p2p"
        return transport, (self.holder_groups if transport == "broadcast" else None)

    def _spag(self, placement: Placement, group) -> SparseAllGather:
        transport, groups = self.transport_for(placement)
        return _spag_op(self.owners, placement, self.numel, self.slots.dtype, self.slots.device,
                        group, transport, groups)

    def _choose_transport(self, placement: Placement) -> None:
        """``transport="auto"``: time spAG + spRS over ``placement`` with each transport, on
        this layer's real expert rows (interleaved, after a warm-up; the slowest rank's time
        of each repetition), and keep the faster median. Once per layer, at the first
        iteration that moves experts. Only for few, stable holder sets
        (:func:`~moeflow.strategies.fssdp.transport.broadcast_candidate`): else p2p, untimed."""
        why = broadcast_candidate(placement, self.options.materialize, self.holder_groups)
        if why is not None:
            self.transport, self.transport_reason = "p2p", why
            return
        p2p, bc = time_transports(self.owners, placement, self._owned_rows(), self.group,
                                  self.holder_groups)
        self.transport_ms = (1e3 * p2p, 1e3 * bc)
        self.transport = "broadcast" if bc < p2p else "p2p"

    def wait_prefetched(self) -> tuple[Placement, dict, tuple]:
        """Wait for the early spAG (or run it now) without starting the layer: ``(P',
        received replicas, (send, recv) bytes)`` (benchmarks time the spAG alone with it)."""
        return self._gathered()

    def _gathered(self) -> tuple[Placement, dict, tuple]:
        if self.world == 1:                 # every expert is owned here: P' = P
            return self.next_placement(), {}, (0, 0)
        if self._pending is None:
            placement = self.next_placement()
            got, nbytes = _run_spag(self._spag(placement, self.group), self.owners, self.rank,
                                    self._owned_rows())
            return placement, got, nbytes
        placement, future, hand = self._pending
        self._pending = None
        timeout = group_timeout(self.lane_group).total_seconds()
        (got, nbytes), done = _result(future, timeout)
        hand.consume(done, list(got.values()))
        return placement, got, nbytes

    # -- the layer's hooks ------------------------------------------------------------------
    def begin(self, lane: CommLane | None = None) -> HeldFFN:
        """Before routing: wait for this iteration's spAG (or run it now). The held experts
        are bound by :meth:`plan`, after the optional calibration. ``lane``: the layer's
        communication lane (``overlap_backward`` runs the spRS there)."""
        self.lane = lane
        if (self.options.materialize == "sparse" and self.options.overlap_degree is None
                and not self.non_moe.started):     # the same on every rank: no collective yet
            raise ConfigError(
                "MoEConfig.fssdp.materialize='sparse' derives Algorithm 1's overlap degree t "
                "from T_non-MoE, the time from the layer's prefetch() (the GPT block calls it "
                "before its attention) to its forward, and this layer ran without a "
                "prefetch() before it, so t would be 0 (static placement): call "
                "layer.prefetch() before the work that precedes the layer, or give "
                "fssdp.overlap_degree")
        self.non_moe.stop()
        placement, got, nbytes = self._gathered()
        self.bytes["spag"] = nbytes
        self._current = (placement, got)
        return self.held

    def plan(self, experts: torch.Tensor, capacity: int | None, training: bool | None = None):
        """Collective. ``training``: a training forward, whose loads enter the window (default:
        grad enabled; a reentrant checkpoint's first forward runs without grad). Exchange the counts (with this rank's measured times), update the load
        window, calibrate ``P'`` if asked (Section 4.2), stack the held experts
        (:class:`_Gather`, whose backward is spRS), bind them, and return the dispatch plan
        over ``P'`` (Section 4.4, :mod:`moeflow.strategies.fssdp.token_plan`)."""
        placement, got = self._current
        extras = [round(self.non_moe.seconds() * 1e6), round(self.expert_phase.seconds() * 1e9
                                                             / max(1, self._my_load()))]
        if self.budgeted:                # this rank's m from its budget, agreed below
            extras.append(self._budget_capacity())
        kept = KeptChoices(experts, self.num_experts, capacity, self.group, self.world, extras)
        self.non_moe_s = float(kept.extras[:, 0].mean()) / 1e6
        self.token_s = float(kept.extras[:, 1].mean()) / 1e9
        if self.budgeted:                # the smallest rank's m: every rank plans the same P'
            self.memory_capacity = int(kept.extras[:, 2].min())
        loads = kept.every.sum(0)
        if self.options.calibrate and self.world > 1 and self.token_s > 0:
            better = calibrate(self.owners, placement, kept.every, self.overlap(),
                               self.memory_capacity, self.local_size, self.token_s,
                               self.expert_bytes, self.bandwidth or float("inf"),
                               row_bytes=self._row_bytes())
            if better != placement:                     # the extra spAG, on the critical path
                extra = self.owners.materialize(
                    [{self.owners.owners[e]} | (set(better.holders[e]) - set(h))
                     for e, h in enumerate(placement.holders)])
                more, nb = _run_spag(self._spag(extra, self.group), self.owners, self.rank,
                                     self._owned_rows())
                got = {**got, **more}
                self.bytes["spag_calibration"] = nb
                placement = better
                self.calibrated += 1
        if torch.is_grad_enabled() if training is None else training:
            # training forwards only: evaluation batches are not the load Algorithm 1 plans
            # for (w = 5, Section 4.2)
            self.window.add(loads)
        flat = _Gather.apply(self.slots, self, placement, got, self._held_dtype())
        self._current = (placement, flat)
        self.held.bind(self._views(flat))
        plan, routes = fssdp_plan(kept, placement, self.rank, self.local_size)
        self.last_loads = routes.sum(axis=(0, 1))
        self.last_placement = placement
        self.expert_phase.start(self.slots.device)
        return plan

    def _budget_capacity(self) -> int:
        """This rank's ``m`` from its memory budget (:mod:`moeflow.strategies.fssdp.memory`):
        the device's free memory at start (one measurement per process and device, before any
        layer stacks held experts, so every layer gets the same ``m`` whatever its depth) and
        the worst-case peak of this layer's held experts, gradients and transport buffers."""
        o = self.options
        free = free_at_start(self.slots.device, free_bytes)
        if free is None and o.memory_budget_fraction is not None:
            raise ConfigError(f"MoEConfig.fssdp.memory_budget_fraction="
                              f"{o.memory_budget_fraction!r} needs the free memory, which "
                              f"cannot be measured on {self.slots.device}: give "
                              "memory_budget_bytes instead")
        self.memory_free = free
        return capacity_from_budget(o.memory_budget_bytes, o.memory_budget_fraction, free,
                                    self.expert_bytes, owned=len(self.slot_index),
                                    world=self.world, slot_rows=self.slots.shape[0],
                                    num_experts=self.num_experts,
                                    transport=self.options.transport)

    def _held_dtype(self) -> torch.dtype:
        """The dtype of the materialized held experts. HECATE-RM under autocast (e.g. bf16):
        the autocast dtype, since autograd would otherwise save autocast's bf16 copies of the
        fp32 views for the backward, and freeing the fp32 storage (:meth:`end`) would free only
        part of the held experts' memory while the refill re-gathers data no backward reads.
        Materialized in bf16, autocast's casts are no-ops, the saved tensors are views of the
        freed storage, and the refill restores what the backward reads. Without biases only:
        an fp32 bias added to a bf16 product promotes the sum to fp32, a bf16 one would not."""
        device = self.slots.device.type
        if not (self.options.rematerialize and torch.is_grad_enabled() and self.world > 1
                and torch.is_autocast_enabled(device)) or self.held.has_bias:
            return self.slots.dtype
        dtype = torch.get_autocast_dtype(device)
        return dtype if dtype.itemsize < self.slots.dtype.itemsize else self.slots.dtype

    def _my_load(self) -> int:
        return int(self.last_loads[self.rank]) if self.last_loads is not None else 0

    # -- a checkpoint's recomputation (module docstring) ------------------------------------
    def replay_begin(self, placement: Placement) -> HeldFFN:
        """The recomputation's spAG of the recorded ``P'`` (no Algorithm 1, no prefetch)."""
        if self.world == 1:
            got = {}
        else:
            got, self.bytes["spag_backward"] = _run_spag(
                self._spag(placement, self.group), self.owners, self.rank, self._owned_rows())
        self._current = (placement, got)
        return self.held

    def replay_plan(self, plan, placement: Placement):
        """The recorded plan over the recorded ``P'``, its experts stacked and bound again (the
        stacking's backward is spRS, as in :meth:`plan`)."""
        _, got = self._current
        flat = _Gather.apply(self.slots, self, placement, got, self._held_dtype())
        self._current = (placement, flat)
        self.held.bind(self._views(flat))
        return plan

    def end(self, back: torch.Tensor, checkpointed: bool = False, timed: bool = True
            ) -> torch.Tensor:
        """After the experts' exchange: with re-materialization, free the held experts (their
        second spAG runs when the backward reaches this point). ``checkpointed``: the call
        runs under a checkpoint, whose recomputation gathers them again (no free, no second
        spAG here); ``timed=False``: a recomputation, not measured for Algorithm 1."""
        if timed:
            self.expert_phase.stop()
        placement, flat = self._current
        self._current = None
        self.held.bind({})
        self.last_ticket = None
        if not checkpointed and self.options.rematerialize and back.requires_grad \
                and self.world > 1:
            nbytes = flat.untyped_storage().nbytes()
            flat.untyped_storage().resize_(0)
            self.last_ticket = regather.RegatherTicket(flat, nbytes, placement)
            back = _Regather.apply(back, self, [self.last_ticket])
        if self.options.overlap_backward and back.requires_grad and self.world > 1:
            back = _DrainBackward.apply(back)   # backward: before _Regather's refill
        return back

    def launch_sprs(self, op: SparseReduceScatter, chunks: dict, lane: CommLane) -> None:
        """``overlap_backward``: run the spRS on ``lane`` (HECATE Section 3.2: it overlaps the
        attention backward); the owners' gradient rows are added by :func:`drain_backward`,
        queued to run at the end of this backward at the latest."""
        dev = self.slots.device
        hand = Handoff(lane, dev)
        ready = hand.ready()
        tensors = list(chunks.values())

        def task():
            hand.enter(ready, tensors)
            out = op(chunks)
            return out, hand.leave()

        _BACKWARD_PENDING.append((self, op, lane.submit(task, dev), hand))
        self.sprs_on_lane += 1
        torch.autograd.Variable._execution_engine.queue_callback(drain_backward)

    def finish_sprs(self, op: SparseReduceScatter, future: Future, hand: Handoff) -> None:
        """Wait for a launched spRS (bounded by the group's timeout) and add its sums to the
        owned rows of ``slots.grad``: the same values the synchronous path returns to
        autograd (each row gets one layer's sum; the other rows stay as they are)."""
        timeout = group_timeout(self.lane_group).total_seconds()
        out, done = _result(future, timeout, "spRS")
        hand.consume(done, list(out.values()))
        self.bytes["sprs"] = (op.send_bytes, op.recv_bytes)
        grad = self.slots.grad
        if grad is None:
            grad = self.slots.grad = torch.zeros_like(self.slots)
        with torch.no_grad():
            for e, i in self.slot_index.items():
                grad[i] += out[e]

    def regather_on_grad(self, t: torch.Tensor, lane: CommLane) -> None:
        """``overlap_regather``: launch the last forward's re-gathering spAG (HECATE-RM's
        second spAG) on a communication lane when the backward computes ``t``'s gradient (the
        next block's attention output: Section 3.2, the spAG under the attention backward).
        The lane is the one carrying a pending ``overlap_backward`` spRS, if any (one thread
        issues the backward's lane collectives, in order), else ``lane``. Once per forward;
        a no-op without a freed forward (no RM, no grad, a checkpointed call)."""
        ticket, self.last_ticket = self.last_ticket, None
        if ticket is None or not self.options.overlap_regather:
            return
        regather.on_grad(t, lambda: self.launch_regather(ticket, lane))

    def launch_regather(self, ticket: regather.RegatherTicket, lane: CommLane) -> None:
        """Queue ``ticket``'s spAG on the backward's lane (inside a backward: hook time)."""
        lane = _BACKWARD_PENDING[-1][0].lane if _BACKWARD_PENDING else lane
        op = self._spag(ticket.placement, self.lane_group)  # groups exist: made in forward
        owned = self._owned_rows()
        if regather.launch(ticket, lambda: _run_spag(op, self.owners, self.rank, owned),
                           list(owned.values()), lane, self.slots.device):
            self.regather_on_lane += 1
            timeout = group_timeout(self.lane_group).total_seconds()
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: regather.settle(ticket, timeout))

    def refill(self, ticket: regather.RegatherTicket) -> None:
        """The second spAG of HECATE-RM: the freed held experts, back into their storage
        (the spAG ``overlap_regather`` launched, or one run now)."""
        flat, nbytes, placement = ticket.flat, ticket.nbytes, ticket.placement
        held = placement.held(self.rank)
        t0 = time.perf_counter()
        early = regather.collect(ticket, group_timeout(self.lane_group).total_seconds())
        if early is None:
            got, nbytes_ag = _run_spag(self._spag(placement, self.group), self.owners,
                                       self.rank, self._owned_rows())
        else:
            got, nbytes_ag = early
        self.regather_exposed_s = time.perf_counter() - t0
        ticket.spent, ticket.flat = True, None
        flat.untyped_storage().resize_(nbytes)
        data = flat.data             # own version counter: the graph's saved views stay valid
        with torch.no_grad():
            for i, e in enumerate(held):
                data[i].copy_(self.slots.detach()[self.slot_index[e]] if e in self.slot_index
                              else got[e])
        self.bytes["spag_backward"] = nbytes_ag

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, at = {}, 0
        for name, shape in self.shapes.items():
            n = math.prod(shape)
            out[name] = flat[:, at:at + n].view((flat.shape[0],) + shape)
            at += n
        return out

    def stats(self) -> dict[str, float]:
        """Metrics of the last forward (in ``MoELayer.stats``; ``moeflow bench hecate`` reads
        them): tokens each rank computed, the max/mean load ratio, and this rank's spAG / spRS
        bytes sent (spRS: the last backward's)."""
        out: dict[str, float] = {}
        if self.last_loads is not None:
            loads = self.last_loads
            mean = float(loads.mean())
            out["fssdp_load_max_over_mean"] = float(loads.max()) / mean if mean else 1.0
            out.update({f"fssdp_load_rank{r}": float(n) for r, n in enumerate(loads)})
        out["spag_send_bytes"] = float(self.bytes.get("spag", (0, 0))[0])
        out["sprs_send_bytes"] = float(self.bytes.get("sprs", (0, 0))[0])
        if self.transport is not None:
            out["fssdp_transport_broadcast"] = float(self.transport == "broadcast")
        if self.transport_ms is not None:
            out["fssdp_auto_p2p_ms"], out["fssdp_auto_broadcast_ms"] = self.transport_ms
        placement = getattr(self, "last_placement", None)
        if placement is not None:        # every rank's volume follows from P, P' (Eq. 1-2)
            p0, p1, chunk = placement.owner_chunks(), placement.holder_chunks(), \
                self.expert_bytes          # P of that forward (a re-shard may follow it)
            out["spag_bytes_all_ranks"] = float(sum(spag_send_bytes(p0, p1, chunk,
                                                                    self.world)))
            out["sprs_bytes_all_ranks"] = float(sum(sprs_send_bytes(p1, p0, chunk,
                                                                    self.world)))
        return out

    def set_owners(self, owners: Placement, slots: nn.Parameter,
                   slot_index: dict[int, int]) -> None:
        """A new shard map (Algorithm 2's re-sharding, :mod:`moeflow.strategies.fssdp.reshard`):
        this layer's owned experts are rows ``slot_index`` of ``slots``. Manual holders are
        dropped (they must contain the owners)."""
        self.owners = Placement.static(owners.owners, owners.world_size)
        self.slots = slots
        self.slot_index = dict(slot_index)
        self.holders = None

    # -- global views (checkpoints, tests) --------------------------------------------------
    def owned_experts(self) -> dict[int, dict[str, torch.Tensor]]:
        """``{expert: {name: tensor}}`` of the experts this rank owns (views of ``slots``)."""
        out = {}
        for e, i in self.slot_index.items():
            out[e] = {n: v[0] for n, v in self._views(self.slots.detach()[i:i + 1]).items()}
        return out


def _result(future: Future, timeout: float, what: str = "spAG"):
    try:
        return future.result(timeout=timeout)
    except TimeoutError as err:
        raise TimeoutError(f"FSSDP {what} did not finish within the process group's timeout "
                           f"({timeout:.0f} s): a peer did not join") from err


__all__ = ["FSSDPExperts", "HeldFFN", "SPAG", "drain_backward"]
