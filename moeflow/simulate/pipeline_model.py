"""A pipeline-parallel step as a dependency graph (``moeflow simulate train --pp``): every
pipeline rank runs its actions (:mod:`.pipeline_order`, torch's own order) one after the
other on its computing lane, each action starting when the rank is free and its inputs have
arrived; the bubble is what falls out, not a closed form (GPipe, Huang et al. 2019 Section 2.2;
Narayanan et al. 2021 Section 2.2; Qi et al. 2024 Section 2; DeepSeek-V3 Section 3.2.1).

The edges, for stage ``s`` and micro-batch ``m`` (``n`` stages):

- ``F(s, m)`` needs ``F(s - 1, m)``'s activations;
- the backward of the input (``B`` full, or ``I``) of ``(s, m)`` needs ``F(s, m)`` and, below
  the last stage, the input gradient of ``(s + 1, m)``; ``W(s, m)`` needs ``I(s, m)``;
- an activation or gradient between stages on different pipeline ranks is a transfer on the
  sender's send lane (one at a time, in the order the rank produced them) of
  ``send_s[(src rank, dst rank)]`` seconds, issued when its producer ends; between stages on one
  rank (the V schedules' turn) nothing is sent.

A stage's chunk times come from :class:`StageTimes` (one micro-batch): ``F``, ``I`` and ``W``
(a full backward is ``I + W``). DualPipeV's ``FB`` pair runs its forward and its full
backward one after the other, or, overlapped (``--pp-overlap``), as :func:`overlapped_pair_s`
interleaves them: two halves taking strict turns at each MoE exchange, one micro-batch's
exchange in flight while the other computes (DeepSeek-V3 Section 3.2.1's computation-
communication overlap of a forward and a backward chunk). A pair's outputs are sent when the
pair ends (torch's runtime sends after the whole action).

Per rank: busy (its actions' seconds), idle (the schedule's span minus busy) and the bubble
``1 - busy / span``, the span being the last action's end over all ranks (the runner's
statistics all-reduce over the pipeline ranks ends every rank's schedule together).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.errors import ConfigError
from moeflow.simulate import engine
from moeflow.simulate.engine import SimTask
from moeflow.simulate.pipeline_order import Act

Segments = tuple[tuple[str, float], ...]   # ("c", compute s) / ("x", exchange s), in order


@dataclass(frozen=True)
class StageTimes:
    """One stage on one micro-batch: forward, backward of the input, backward of the weights
    (seconds); the segments of the forward and of the full backward (compute / MoE exchange
    in their order) for the overlapped pairs."""

    forward_s: float
    input_s: float
    weight_s: float = 0.0
    forward_segments: Segments = ()
    backward_segments: Segments = ()

    @property
    def backward_s(self) -> float:
        return self.input_s + self.weight_s


def overlapped_pair_s(forward: Segments, backward: Segments) -> float:
    """Seconds of an overlapped pair: the forward half first; a half runs its compute until it
    issues an exchange, then hands the turn to the other half (while that one has work left)
    and, given the turn back, waits for its exchange; the exchanges of both halves share one
    communication lane, in issue order (the same process groups)."""
    parts, idx = {"F": list(forward), "B": list(backward)}, {"F": 0, "B": 0}
    pending: dict[str, float | None] = {"F": None, "B": None}
    done: set[str] = set()
    t = comm_free = 0.0
    me = "F"
    while len(done) < 2:
        other = "B" if me == "F" else "F"
        if pending[me] is not None:
            t, pending[me] = max(t, pending[me]), None
        handed = False
        while idx[me] < len(parts[me]):
            kind, s = parts[me][idx[me]]
            idx[me] += 1
            if kind == "c":
                t += s
                continue
            start = max(t, comm_free)
            comm_free = pending[me] = start + s
            if other not in done:
                handed = True
                break
            t, pending[me] = max(t, pending[me]), None
        if not handed:
            done.add(me)
        me = other
    return t


def _pair_s(act: Act, stages: list[StageTimes], overlap: bool) -> float:
    f, b = act.sub
    sf, sb = stages[f.stage], stages[b.stage]
    if not overlap:
        return sf.forward_s + sb.backward_s
    if not sf.forward_segments or not sb.backward_segments:
        raise ConfigError("an overlapped pair needs the stages' forward / backward segments "
                          "(StageTimes.forward_segments, backward_segments)")
    return overlapped_pair_s(sf.forward_segments, sb.backward_segments)


def _seconds(act: Act, stages: list[StageTimes], overlap: bool) -> float:
    if act.kind == "FB":
        return _pair_s(act, stages, overlap)
    st = stages[act.stage]
    return {"F": st.forward_s, "B": st.backward_s, "I": st.input_s, "W": st.weight_s}[act.kind]


def simulate_pipeline(order: dict[int, list[Act]], stages: list[StageTimes],
                      send_s: dict[tuple[int, int], float], overlap: bool = False) -> dict:
    """The schedule's span, per-rank busy / idle / bubble and every action's start and end.
    ``order``: :func:`~moeflow.simulate.pipeline_order.torch_order`; ``stages[s]``: stage ``s``'s
    chunk times; ``send_s[(a, b)]``: seconds of one activation (or gradient) from pipeline rank
    ``a`` to ``b``; ``overlap``: run the ``FB`` pairs overlapped."""
    n = len(stages)
    rank_of: dict[int, int] = {}
    for rank, acts in order.items():
        for a in acts:
            for x in (a.sub or (a,)):
                if rank_of.setdefault(x.stage, rank) != rank:
                    raise ConfigError(f"stage {x.stage} is run by ranks {rank_of[x.stage]} and "
                                      f"{rank}")
    if sorted(rank_of) != list(range(n)):
        raise ConfigError(f"the order runs stages {sorted(rank_of)}, the model has {n}")
    compute = {r: [] for r in order}
    sends = {r: [] for r in order}
    # (kind, stage, mb) -> the task whose end makes it available; "out": the transfer's
    done: dict[tuple[str, int, int], SimTask] = {}
    tasks: list[tuple[Act, SimTask]] = []
    for rank, acts in order.items():
        for a in acts:
            t = SimTask(str(a), rank, "compute", "compute", "pipeline",
                        _seconds(a, stages, overlap))
            compute[rank].append(t)
            tasks.append((a, t))
            for x in (a.sub or (a,)):
                key = "F" if x.kind == "F" else "I" if x.kind in ("B", "I") else "W"
                done[(key, x.stage, x.mb)] = t
    arrived: dict[tuple[str, int, int], SimTask] = {}
    for rank, acts in order.items():     # the transfers, in the order the rank produces
        for a in acts:
            for x in (a.sub or (a,)):
                if x.kind == "F" and x.stage + 1 < n:
                    dst, key = x.stage + 1, ("F", x.stage, x.mb)
                elif x.kind in ("B", "I") and x.stage > 0:
                    dst, key = x.stage - 1, ("I", x.stage, x.mb)
                else:
                    continue
                src_rank, dst_rank = rank, rank_of[dst]
                if src_rank == dst_rank:
                    arrived[key] = done[key]
                    continue
                if (src_rank, dst_rank) not in send_s:
                    raise ConfigError(f"no send time from pipeline rank {src_rank} to "
                                      f"{dst_rank}")
                s = SimTask(f"send {x}", rank, "send", "send", "pipeline",
                            send_s[(src_rank, dst_rank)], deps=[done[key]])
                sends[rank].append(s)
                arrived[key] = s
    for a, t in tasks:
        for x in (a.sub or (a,)):
            deps = []
            if x.kind == "F" and x.stage > 0:
                deps.append(arrived[("F", x.stage - 1, x.mb)])
            elif x.kind in ("B", "I"):
                if done[("F", x.stage, x.mb)] is not t:
                    deps.append(done[("F", x.stage, x.mb)])
                if x.stage + 1 < n:
                    deps.append(arrived[("I", x.stage + 1, x.mb)])
            elif x.kind == "W":
                deps.append(done[("I", x.stage, x.mb)])
            t.deps.extend(d for d in deps if d is not t and d not in t.deps)
    lanes = {(r, "compute"): v for r, v in compute.items()}
    lanes.update({(r, "send"): v for r, v in sends.items()})
    engine.run(lanes)
    span = max([t.end for v in compute.values() for t in v] + [0.0])
    ranks = []
    for r in sorted(order):
        busy = sum(t.seconds for t in compute[r])
        ranks.append({"rank": r, "busy_s": busy, "idle_s": span - busy,
                      "bubble": 1.0 - busy / span if span else 0.0,
                      "send_s": sum(t.seconds for t in sends[r])})
    return {"span_s": span, "ranks": ranks,
            "bubble_mean": sum(x["bubble"] for x in ranks) / len(ranks),
            "actions": [{"rank": t.rank, "action": t.name, "start_s": t.start, "end_s": t.end}
                        for v in compute.values() for t in v]}


__all__ = ["Segments", "StageTimes", "overlapped_pair_s", "simulate_pipeline"]
