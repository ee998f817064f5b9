"""``moeflow bench pipeline``: expert parallelism against pipeline parallelism beside it, at
one global batch, every configuration in one launch, interleaved round by round.

Each rank builds one ``Trainer`` per configuration (:mod:`moeflow.bench.pipeline_cases`),
runs ``warmup`` untimed steps of each, one untimed step of each under the memory count, then
``reps`` rounds of one timed step of each configuration (ranks aligned by barriers). Per
timed step and rank it records:

- the step's seconds (tokens/s: the global batch's tokens over the slowest rank's step);
- under a pipeline, the schedule's seconds (``PipelineRunner.forward_backward``) and the
  seconds inside the stages' compute (torch's ``PipelineStage.forward_one_chunk``,
  ``backward_one_chunk``, ``backward_weight_one_chunk``, the MoE exchanges inside them
  included; the union of their spans, so an overlapped pair's two chunks count once): the
  measured bubble is the rest, ``1 - compute / schedule``, set beside the
  schedule's theoretical share (:mod:`moeflow.bench.pipeline_bubble`) from the mean chunk
  times of all ranks;
- the MoE layers' all-to-all: the comm-lane seconds of each layer's timeline, and the part of
  them no compute task of the same layer covered (exposed; ScheMoE Section 4's overlap);
- the all-to-all clock (:class:`~moeflow.pipeline_parallel.a2a_clock.A2AClock`): the
  exchanges' issue-to-completion seconds (``clock_total_s``) and the seconds the rank blocked
  waiting for them (``clock_exposed_s``), which also counts what another micro-batch's compute
  hid (DualPipe's overlapped pairs, DeepSeek-V3 Section 3.2.1, ``--pp-overlap``); a case's
  ``a2a_hidden_share`` is ``1 - exposed / total`` over its ranks and timed steps.

Memory is counted in tensor bytes, not RSS (which the allocator's reuse across the
configurations of one process blurs): the parameters and optimizer state live at a step's
start plus the peak of the bytes allocated minus freed during one step (torch.profiler's
memory events on CPU; ``max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from moeflow.bench.pipeline_bubble import bubble_share
from moeflow.bench.pipeline_cases import PipelineCase, case_train_config
from moeflow.comm import wait_watch
from moeflow.layer import MoELayer
from moeflow.pipeline_parallel.a2a_clock import A2AClock
from moeflow.schedule.executor import Timeline
from moeflow.schedule.overlap import overlap_fraction

MEMORY_COUNT = ("tensor bytes: parameters + optimizer state at the step's start, plus the "
                "step's peak of bytes allocated minus freed (torch.profiler memory events on "
                "cpu, max_memory_allocated on cuda)")
_CHUNKS = {"forward": "forward_one_chunk", "backward": "backward_one_chunk",
           "weight": "backward_weight_one_chunk"}


class _Timers:
    """Seconds and calls of the wrapped methods since the last :meth:`reset` (on CUDA the
    device is synchronised at both ends, so a chunk's kernels count, not their launch), and
    ``compute``: the seconds during which at least one chunk ran (an overlapped pair's two
    chunks run at once, DeepSeek-V3 Section 3.2.1; their union counts once)."""

    def __init__(self, device: torch.device):
        self.cuda = device if device.type == "cuda" else None
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        self.s = {k: 0.0 for k in (*_CHUNKS, "schedule", "compute")}
        self.n = {k: 0 for k in self.s}
        self._active, self._since = 0, 0.0

    def _span(self, key: str, t: float, step: int) -> None:
        """A chunk begins (``step`` 1) or ends (-1) at ``t``: the union of their spans."""
        with self._lock:
            self._since = t if self._active == 0 else self._since
            self._active += step * (key in _CHUNKS)
            self.s["compute"] += (t - self._since) * (self._active == 0 and key in _CHUNKS)

    def wrap(self, obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            if self.cuda is not None:
                torch.cuda.synchronize(self.cuda)
            t0 = time.perf_counter()
            self._span(key, t0, 1)
            try:
                return fn(*args, **kwargs)
            finally:
                if self.cuda is not None:
                    torch.cuda.synchronize(self.cuda)
                t1 = time.perf_counter()
                self._span(key, t1, -1)
                with self._lock:
                    self.s[key] += t1 - t0
                    self.n[key] += 1
        setattr(obj, attr, timed)


class _CaseRun:
    def __init__(self, case: PipelineCase, mcfg, tcfg, out_dir: str):
        from moeflow.topology import Topology
        from moeflow.trainer import Trainer

        self.case, self.tcfg = case, tcfg
        topo = Topology.from_env() if case.pp > 1 else Topology.from_env(ep_size=tcfg.ep_size)
        self.trainer = Trainer(mcfg, tcfg, out_dir, topo, progress=False)
        self.layers = [m for m in self.trainer.model.modules() if isinstance(m, MoELayer)]
        self.timers = _Timers(self.trainer.device)
        runner = self.trainer.pipeline
        if runner is not None:
            for stage in runner.pipe_stages:
                for key, attr in _CHUNKS.items():
                    self.timers.wrap(stage, attr, key)
            self.timers.wrap(runner, "forward_backward", "schedule")
        self.samples: list[dict] = []

    def timed_step(self) -> dict:
        self.timers.reset()
        for layer in self.layers:
            layer.timeline = Timeline()
        # a pipeline's runner installs its own clock for its schedule; ep: this one
        clock = getattr(self.trainer.pipeline, "a2a_clock", None) or A2AClock()
        clock.take()
        previous = wait_watch.install(clock)
        dist.barrier()
        t0 = time.perf_counter()
        try:
            self.trainer.train_step()
            if self.trainer.device.type == "cuda":
                torch.cuda.synchronize(self.trainer.device)
        finally:
            wait_watch.install(previous)
        dist.barrier()
        step = time.perf_counter() - t0
        timed = clock.take()
        a2a = exposed = 0.0
        for layer in self.layers:
            comm = sum(r.end - r.start for r in layer.timeline.records if r.lane == "comm")
            a2a += comm
            exposed += comm * (1.0 - overlap_fraction(layer.timeline.records))
            layer.timeline = None
        return {"step_s": step, "a2a_s": a2a, "a2a_exposed_s": exposed,
                "clock_total_s": timed["a2a_total_s"], "clock_exposed_s": timed["a2a_exposed_s"],
                "clock_count": timed["a2a_count"], "clock_handed": timed["a2a_handed"],
                "chunk_s": dict(self.timers.s), "chunk_n": dict(self.timers.n)}

    def memory(self) -> dict:
        """Tensor bytes: parameters and optimizer state, and one step's peak above them."""
        opt, device = self.trainer.opt, self.trainer.device
        state = sum(p.numel() * p.element_size() for p in self.trainer.model.parameters())
        state += sum(t.numel() * t.element_size() for s in opt.state.values()
                     for t in s.values() if torch.is_tensor(t))
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            self.trainer.train_step()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                self.trainer.train_step()
            events = sorted((e.start_ns(), e.nbytes())
                            for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]")
            live = peak = 0
            for _, nbytes in events:
                live += nbytes
                peak = max(peak, live)
        return {"state_bytes": state, "step_peak_bytes": peak, "peak_bytes": state + peak}


def bench_worker(cases: list[PipelineCase], mcfg, global_batch: int, micro: int,
                 warmup: int, reps: int, device_name: str) -> dict:
    """One rank's part (torch.distributed initialised); rank 0 returns the record."""
    world, load_start = dist.get_world_size(), os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(cases):
            tcfg = case_train_config(case, world, global_batch, micro, warmup + 1 + reps)
            tcfg.device = device_name
            runs.append(_CaseRun(case, mcfg, tcfg, f"{tmp}/{i}"))
        for run in runs:
            for _ in range(warmup):
                run.trainer.train_step()
        memory = [run.memory() for run in runs]
        for _ in range(reps):                          # interleaved, round by round
            for run in runs:
                run.samples.append(run.timed_step())
    mine = [{"memory": mem, "samples": run.samples} for run, mem in zip(runs, memory)]
    every = [None] * world
    dist.all_gather_object(every, mine)
    if dist.get_rank() != 0:
        return {}
    tokens = global_batch * mcfg.seq_len
    return {"world": world, "global_batch": global_batch, "tokens_per_step": tokens,
            "micro_batches": micro, "warmup": warmup, "reps": reps, "load_start": load_start,
            "load_end": os.getloadavg(), "memory_count": MEMORY_COUNT,
            "a2a_count": "comm-lane seconds of the MoE layers' timelines; exposed: not covered "
                         "by the same layer's compute tasks",
            "clock_count": "A2AClock: exchanges' issue-to-completion (total) and blocked-in-"
                           "wait (exposed) seconds; a2a_hidden_share = 1 - exposed / total",
            "cases": [summarise(run.case, run.tcfg, [every[r][i] for r in range(world)],
                                tokens, micro) for i, run in enumerate(runs)]}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _compute_s(chunk_s: dict) -> float:       # the union; the sum in records without it
    return chunk_s.get("compute", sum(chunk_s[k] for k in _CHUNKS))


def _hidden_share(ranks: list[dict]) -> float | None:
    """``1 - exposed / total`` of the clock over every rank and step (None: none timed)."""
    total, exposed = (sum(s[k] for r in ranks for s in r["samples"])
                      for k in ("clock_total_s", "clock_exposed_s"))
    return 1.0 - exposed / total if total > 0 else None


def summarise(case: PipelineCase, tcfg, ranks: list[dict], tokens: int, micro: int) -> dict:
    """A configuration's figures from every rank's samples (``ranks[r]``)."""
    reps = len(ranks[0]["samples"])
    steps = [max(r["samples"][i]["step_s"] for r in ranks) for i in range(reps)]
    out = {"name": case.name, "pp": case.pp, "schedule": case.schedule if case.pp > 1 else None,
           "overlap": case.overlap if case.pp > 1 else None,
           "layout": case.layout if case.pp > 1 else None, "batch_size": tcfg.batch_size,
           "grad_accum": tcfg.grad_accum, "step_s": steps,
           "tokens_per_s": _spread([tokens / s for s in steps]),
           "memory_per_rank": [r["memory"] for r in ranks],
           "a2a_per_rank": [{k: _spread([s[k] for s in r["samples"]])
                             for k in ("a2a_s", "a2a_exposed_s", "clock_total_s",
                                       "clock_exposed_s")} for r in ranks],
           "a2a_hidden_share": _hidden_share(ranks),
           "samples_per_rank": [r["samples"] for r in ranks]}
    if case.pp > 1:
        idle = [[1.0 - _compute_s(s["chunk_s"]) / s["chunk_s"]["schedule"]
                 for s in r["samples"]] for r in ranks]
        mean = {k: sum(s["chunk_s"][k] for r in ranks for s in r["samples"])
                / max(1, sum(s["chunk_n"][k] for r in ranks for s in r["samples"]))
                for k in _CHUNKS}
        theory = bubble_share(case.schedule, case.pp, micro, mean["forward"],
                              mean["backward"], mean["weight"])
        out["bubble"] = {"measured_per_rank": [_spread(v) for v in idle],
                         "measured_mean": statistics.mean(statistics.median(v) for v in idle),
                         "theory": theory, "chunk_mean_s": mean}
    return out


def format_table(res: dict) -> str:
    rows = [f"{'config':34s} {'tokens/s median [min-max]':>28s} {'peak MiB/rank (max)':>20s} "
            f"{'bubble meas/theory':>19s} {'a2a exposed/total s':>20s} {'hidden':>7s}"]
    for c in res["cases"]:
        t = c["tokens_per_s"]
        mem = max(m["peak_bytes"] for m in c["memory_per_rank"]) / 2**20
        b = c.get("bubble")
        bub = f"{b['measured_mean']:.2f}/{b['theory']:.2f}" if b else "-"
        a2a = (statistics.mean(a["clock_exposed_s"]["median"] for a in c["a2a_per_rank"]),
               statistics.mean(a["clock_total_s"]["median"] for a in c["a2a_per_rank"]))
        hid = c["a2a_hidden_share"]
        rows.append(f"{c['name']:34s} {t['median']:>10.0f} [{t['min']:.0f}-{t['max']:.0f}]"
                    f"{'':>4s} {mem:>20.1f} {bub:>19s} {a2a[0]:>9.3f}/{a2a[1]:<9.3f}"
                    f" {'-' if hid is None else f'{hid:.2f}':>7s}")
    return "\n".join(rows)
