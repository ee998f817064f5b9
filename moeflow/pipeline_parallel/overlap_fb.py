"""DualPipe's overlapped forward / backward pair (DeepSeek-V3 Section 3.2.1: "overlap the
computation and communication within a pair of individual forward and backward chunks"):
torch's ``ScheduleDualPipeV`` emits ``OVERLAP_F_B`` actions, the forward of one micro-batch
on one stage and the full backward of another on this rank's other stage. Torch runs the two
one after the other; :func:`run_overlapped_pair` (registered for ``OVERLAP_F_B`` with
``_PipelineScheduleRuntime.register_custom_function``) runs them on two threads that take
strict turns (:class:`Turns`): a thread runs until one of its MoE layers has issued an
all-to-all, then hands the turn to the other and waits for it back before it waits for the
exchange (:class:`~moeflow.pipeline_parallel.a2a_clock.A2AClock`). So the dispatch / combine of
one micro-batch is in flight while the other computes its attention, experts or gradients.

One collective order on every rank of a stage: only the thread holding the turn runs, the
turn passes at the same points on every rank (the same layers issue the same exchanges), so
every EP rank issues its collectives in the same deterministic interleave, on the same groups
(the backend queues an asynchronous collective's successors in issue order). Every turn wait
is bounded by the collective timeout. Forward first, as torch's order of the sub-actions.
"""

from __future__ import annotations

import threading

import torch

FORWARD, BACKWARD = "forward", "backward"


def overlaps(tcfg) -> bool:
    """Whether ``TrainConfig`` ``tcfg`` runs the overlapped pairs (``--pp-overlap``; auto: on
    with dualpipev, the one schedule that has them)."""
    return tcfg.pp_schedule == "dualpipev" and tcfg.pp_overlap in ("auto", "on")


class Turns:
    """Two parties, ``forward`` and ``backward``, running one at a time in strict alternation
    (``forward`` first); a finished party hands the turn over for good."""

    def __init__(self, timeout_s: float):
        self._cv = threading.Condition()
        self._holder = FORWARD
        self._done: set[str] = set()
        self.timeout_s = timeout_s

    def _wait_for(self, me: str) -> None:
        if not self._cv.wait_for(lambda: self._holder == me, self.timeout_s):
            raise RuntimeError(f"the overlapped pipeline pair's {me} waited {self.timeout_s} s "
                               "for its turn (--timeout): the other micro-batch is stuck")

    def begin(self, me: str) -> None:
        with self._cv:
            self._wait_for(me)

    def pass_turn(self) -> bool:
        """Hand the turn to the other party and wait for it back; False (nothing to do) when
        the other has finished."""
        with self._cv:
            me = self._holder
            other = BACKWARD if me == FORWARD else FORWARD
            if other in self._done:
                return False
            self._holder = other
            self._cv.notify_all()
            self._wait_for(me)
            return True

    def finish(self, me: str) -> None:
        with self._cv:
            self._done.add(me)
            if self._holder == me:
                self._holder = BACKWARD if me == FORWARD else FORWARD
            self._cv.notify_all()


class PairThreads:
    """The two threads that run the pairs' halves, kept for the runner's life: a fresh thread
    per pair pays the math libraries' per-thread set-up again and again."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.pools = {name: ThreadPoolExecutor(1, thread_name_prefix=f"moeflow-pp-{name}")
                      for name in (FORWARD, BACKWARD)}

    def run(self, halves: dict, turns: Turns, device_type: str) -> None:
        """Run ``halves[FORWARD]`` and ``halves[BACKWARD]`` in ``turns`` under the caller's
        autocast state (thread-local); re-raise the first error after both ended."""
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)

        def body(name):
            try:
                turns.begin(name)
                with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                    halves[name]()
            finally:
                turns.finish(name)
        futures = {name: self.pools[name].submit(body, name) for name in (FORWARD, BACKWARD)}
        errors = [f.exception() for f in futures.values()]      # waits for both
        for e in errors:
            if e is not None:
                raise e


def run_overlapped_pair(action, ctx, clock, threads: PairThreads, device_type: str,
                        timeout_s: float) -> None:
    """Run ``action`` (``OVERLAP_F_B``: a ``FORWARD`` and a ``FULL_BACKWARD`` sub-action) with
    the two halves overlapped; the bookkeeping around them as torch's runtime does it for the
    sub-actions one at a time (receives waited, the loss computed and kept, the same-rank
    hand-over of the V schedules)."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    sched = ctx.schedule_ref
    fwd, bwd = action.sub_actions
    stages = {s.stage_index: s for s in sched._stages}
    f_stage, b_stage = stages[fwd.stage_index], stages[bwd.stage_index]
    f_mb, b_mb = fwd.microbatch_index, bwd.microbatch_index
    if not f_stage.is_first and fwd.stage_index - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
    if not b_stage.is_last and bwd.stage_index + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((bwd.stage_index, b_mb)))
    loss = sched._maybe_get_loss(b_stage, b_mb)
    sched.backward_counter[bwd.stage_index] += 1
    last = sched.backward_counter[bwd.stage_index] == sched._n_microbatches
    out = {}

    def forward():
        out["y"] = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb],
                                             save_forward_output=False)
        sched._maybe_compute_loss(f_stage, out["y"], ctx.target_mbs, f_mb)

    def backward():
        b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True, last_backward=last)

    turns = Turns(timeout_s)
    clock.turns = turns
    try:
        threads.run({FORWARD: forward, BACKWARD: backward}, turns, device_type)
    finally:
        clock.turns = None
    if fwd.stage_index + 1 in stages:
        stages[fwd.stage_index + 1].set_local_fwd_input(out["y"], f_mb)
    if bwd.stage_index - 1 in stages:
        stages[bwd.stage_index - 1].set_local_bwd_input(b_stage.get_local_bwd_output(b_mb),
                                                        b_mb)
