"""HECATE-RM's re-gathering spAG issued ahead of its layer's backward
(``MoEConfig.fssdp.overlap_regather``; HECATE Section 3.2: with re-materialization
"SparseAllGather is launched twice for an MoE layer in each iteration", and both the spRS and
the second spAG overlap the attention backward).

A forward that frees its held experts (:meth:`moeflow.strategies.fssdp.layer_experts.FSSDPExperts.end`)
leaves a :class:`RegatherTicket`: the freed tensor, its byte size and ``P'``. Its layer's
backward (``_Regather``) refills the tensor from the ticket. A gradient hook on a tensor whose
backward runs just before the layer's (:func:`on_grad`; the GPT uses the next block's attention
output, and the loss for the last MoE layer) launches the ticket's spAG on a communication
lane first (:func:`launch`), so the refill only waits for it (:func:`collect`). No host
synchronisation is added: the lane hands data over with events (:class:`~moeflow.schedule.
streams.Handoff`), and the wait is on the work's future, bounded by the group's timeout.

One collective order per rank (docs/design.md): the launch happens inside the backward, after
the layers behind the trigger have issued their collectives, and the layer's backward waits
for it before issuing its own; the attention backward in between issues none. A ticket
launched whose layer's backward never runs (the trigger was not upstream of it) is waited for
at the end of the backward (:func:`settle`), so no spAG outlives its backward on the lane.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import torch

from moeflow.schedule.streams import CommLane, Handoff


class RegatherTicket:
    """One forward's freed held experts awaiting the second spAG: ``flat`` (storage resized to
    0), ``nbytes`` (its size), ``placement`` (``P'`` of that forward). ``pending``: the launched
    spAG's (future, handoff) until collected; ``spent``: the refill took it."""

    __slots__ = ("flat", "nbytes", "placement", "pending", "spent")

    def __init__(self, flat: torch.Tensor, nbytes: int, placement) -> None:
        self.flat, self.nbytes, self.placement = flat, nbytes, placement
        self.pending: tuple[Future, Handoff] | None = None
        self.spent = False


def launch(ticket: RegatherTicket, run: Callable[[], tuple], owned: list[torch.Tensor],
           lane: CommLane, device: torch.device) -> bool:
    """Queue ``run`` (the spAG over the ticket's ``P'``: returns (received replicas, bytes))
    on ``lane``; ``owned`` are the rows it reads, made on the compute stream. False (nothing
    queued) if the ticket was launched or refilled already."""
    if ticket.spent or ticket.pending is not None:
        return False
    hand = Handoff(lane, device)
    ready = hand.ready()

    def task():
        hand.enter(ready, owned)
        got = run()
        return got, hand.leave()

    ticket.pending = (lane.submit(task, device), hand)
    return True


def collect(ticket: RegatherTicket, timeout: float):
    """The launched spAG's (received replicas, bytes), waited for within ``timeout`` seconds
    and handed to the compute stream; None if it was not launched."""
    if ticket.pending is None:
        return None
    future, hand = ticket.pending
    ticket.pending = None
    try:
        (got, nbytes), done = future.result(timeout=timeout)
    except TimeoutError as err:
        raise TimeoutError(f"FSSDP re-gathering spAG did not finish within the process "
                           f"group's timeout ({timeout:.0f} s): a peer did not join") from err
    hand.consume(done, list(got.values()))
    return got, nbytes


def settle(ticket: RegatherTicket, timeout: float) -> None:
    """End of the backward: wait for a launched spAG that no layer backward collected."""
    if ticket.pending is not None and not ticket.spent:
        collect(ticket, timeout)
        ticket.spent = True


def on_grad(t: torch.Tensor, fire: Callable[[], None]) -> None:
    """Call ``fire`` when the backward computes ``t``'s gradient (before ``t``'s producer runs
    its backward). No-op for a tensor that requires no gradient."""
    if not t.requires_grad:
        return

    def hook(grad):
        fire()
        return None

    t.register_hook(hook)


__all__ = ["RegatherTicket", "collect", "launch", "on_grad", "settle"]
