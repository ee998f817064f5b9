"""The simulated step of one expert-parallel MoE layer (ScheMoE's exchange, Sections 3-4).

The task graph is the library's own: the computing order of each pass is the scheduler's
``order(r)`` (:mod:`moeflow.schedule.schedulers`), communication tasks are issued after their
C task onto one communication lane (inline on the computing lane when the scheduler does not
overlap), as :func:`moeflow.schedule.executor.run_schedule` does; the rows of every chunk and
so the bytes of every all-to-all come from the layer's planning code: the count matrix of
:func:`moeflow.dispatch.plan.make_plan` (from an explicit routing sample, or the uniform
expectation) cut by :func:`moeflow.schedule.chunks.chunk_counts`. Task times come from a
:class:`~moeflow.simulate.costs.CostModel` (ScheMoE Section 4.2's linear task models).

One step is the layer's forward then its backward (what ``moeflow bench layer`` times):
``route``, ``permute``, the count matrix's all-gather, the 7r scheduled tasks, ``combine``;
then ``combine``'s backward, the 7r mirrored tasks (the same chunks and splits; ScheMoE
Section 3.2), ``permute`` and ``route`` backward. Hierarchical all-to-alls run as their
intra- and inter-node phases (:mod:`.exchange`, the splits of :mod:`moeflow.comm.alltoall.phases`);
Pipe-A2A's two streams run at once (ScheMoE Section 5, Eq. 16), the Inter-Stream on the lane
of its own process group beside the communication thread.
Skewed loads are routing samples drawn from an expert popularity (:mod:`.loads`: Zipf, or a
trained router's loads). Codecs: encode / decode as the C / D tasks, compressed rows on the
wire (``Codec.wire_bytes``). ``node_dedup`` (DeepEP's inter-node dispatch): each of the r chunks
of consecutive tokens a whole deduplicated exchange (:func:`.exchange.node_dedup_chunks`), its
hops lane tasks in the scheduler's order in forward and backward, its count exchange one
all-gather of every chunk's counts, its codec on the inter-node hops, encoded and decoded inside
the lane task (:mod:`moeflow.strategies.node_dedup.strategy`). HECATE's placement: :mod:`.fssdp` (the
exchange over held slots, with spAG / spRS); Parm's schedules: :mod:`.parm`. Not modelled yet:
the shared experts' task S.

Recomputation (``LayerSpec.recompute``; docs/training.md, "Activation recomputation"):
``moe_act`` keeps the experts' input rows and reruns the experts' forward inside backward task
E right before differentiating them (:class:`moeflow.schedule.pipeline.ScheduledExperts`,
``backward``), so each backward E costs an experts forward more and nothing is exchanged
again; ``full`` (the block under ``torch.utils.checkpoint``) reruns the layer's forward once
more before its backward -- route, permute, the 7r tasks with both all-to-alls and combine --
minus the count exchange, which the plan record replays (:mod:`moeflow.plan_record`); under
FSSDP one spAG of the recorded ``P'`` runs before it and takes the place of HECATE-RM's
backward spAG. The saved-tensor hooks make the checkpointed forward keep input rows too, so
its backward E also reruns the experts (three expert forwards per step).

BigMac's DCCA structure (``structure="bigmac"``; BigMac, "DCCA: Low-dimensional Communication
Strategy", Eq. 2, and "BigMac Expert Design", Eq. 4): the widths come from the library's own
:func:`moeflow.experts.structure.comm_width` / :func:`~moeflow.experts.structure.expert_hidden`
on the layer's :class:`~moeflow.config.MoEConfig`, and the task graph follows
:meth:`moeflow.layer.MoELayer.forward`: ``route`` reads ``x`` at ``d_model``, then
``descend`` (``z = x W_d``, a ``T x M x rM`` GEMM, the layer's ``project`` phase before the
dispatch), ``permute``, the all-to-alls, the codecs and ``combine`` at the reduced width ``rM``
(Eq. 1's volume times ``r``), the experts ``rM -> F/r -> rM`` (the same FLOPs as a
fine-grained expert), and ``ascend`` (``y W_u``, ``rM -> M``) after ``combine``; backward
mirrors them (``ascend`` first, ``descend`` before ``route``), each projection's backward at
twice its forward FLOPs (input and weight gradients).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from moeflow.dispatch.capacity import capacity
from moeflow.dispatch.plan import make_plan
from moeflow.config import STRUCTURES, MoEConfig
from moeflow.errors import ConfigError
from moeflow.experts.structure import comm_width, expert_hidden
from moeflow.registry import registry
from moeflow.schedule.chunks import chunk_counts
from moeflow.schedule.schedulers import SCHEDULERS
from moeflow.schedule.tasks import Task
from moeflow.simulate import engine, fssdp_model
from moeflow.simulate.costs import CostModel
from moeflow.simulate.engine import SimTask
from moeflow.simulate.exchange_model import (HIERARCHICAL, a2a_seconds, exchange_steps,
                                       node_dedup_chunks)

__all__ = ["LayerSpec", "a2a_seconds", "count_matrix", "simulate_layer", "lane_orders"]
A2AS = ("direct", "pairwise") + HIERARCHICAL        # the all-to-alls with a link model here
COMM_LANES = ("thread", "link")
RECOMPUTES = ("none", "moe_act", "full")     # TrainConfig.recompute's choices
COMM_TASKS = ("counts", "A1", "A2", "spAG", "spRS")    # the collectives of a step
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}


@dataclass(frozen=True)
class LayerSpec:
    """One layer call to simulate: the fields of ``MoEConfig`` and of ``moeflow bench layer``
    that shape the step, and the layout ``nodes x ranks_per_node`` (ranks = EP group)."""

    tokens: int                     # per rank
    d_model: int
    d_expert: int
    num_experts: int
    top_k: int
    capacity_factor: float | None   # None: dropless
    activation: str = "gelu"
    schedule: str = "sequential"
    pipeline_degree: int = 1
    a2a: str = "direct"
    nodes: int = 1
    ranks_per_node: int = 1
    trim_padding: bool = True       # capacity mode sends only kept rows (the CPU default)
    dtype: str = "fp32"
    # "thread": the executor's one communication thread runs every collective in issue order
    # (the library); "link": a lane per link class, so phases of successive all-to-alls on
    # different links overlap (what a stream per link class would allow; not the library's).
    # pipe's two streams run at once under either (two process groups: see _pass_tasks)
    comm_lanes: str = "thread"
    codec: str = "none"             # MoEConfig.codec: the forward's payloads
    codec_backward: bool = False    # MoEConfig.codec_backward: the backward's too
    # "moe_act": backward task E reruns the experts' forward; "full": the whole forward again
    # before the backward (the count exchange replayed, not re-sent); module docstring
    recompute: str = "none"
    # MoEConfig.structure / downscale_factor: "bigmac" descends to r*d_model before dispatch
    # (BigMac Eq. 2); the others communicate at d_model
    structure: str = "vanilla"
    downscale_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("tokens", "d_model", "d_expert", "num_experts", "top_k",
                     "pipeline_degree", "nodes", "ranks_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"LayerSpec.{name}={v!r} is invalid: a positive integer")
        if self.num_experts % self.world:
            raise ConfigError(f"LayerSpec.num_experts={self.num_experts} is invalid for "
                              f"{self.world} ranks: give a multiple of nodes x ranks_per_node")
        if self.top_k > self.num_experts:
            raise ConfigError(f"LayerSpec.top_k={self.top_k} exceeds num_experts="
                              f"{self.num_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"LayerSpec.capacity_factor={self.capacity_factor!r} is invalid: "
                              "a positive number, or None (dropless)")
        if self.a2a not in A2AS:
            raise ConfigError(f"LayerSpec.a2a={self.a2a!r} has no link model in the simulator "
                              f"yet; choose one of {', '.join(A2AS)}")
        if self.a2a in HIERARCHICAL and self.nodes < 2:
            raise ConfigError(f"LayerSpec.a2a={self.a2a!r} needs several nodes (it splits into "
                              f"intra- and inter-node phases); the layout is {self.nodes} node "
                              f"x {self.ranks_per_node} ranks: give nodes >= 2 or a2a='direct'")
        codecs = registry("codec")
        if self.codec not in codecs:
            raise ConfigError(f"LayerSpec.codec={self.codec!r} is not a registered codec; "
                              f"choose one of {', '.join(sorted(codecs))}")
        if self.comm_lanes not in COMM_LANES:
            raise ConfigError(f"LayerSpec.comm_lanes={self.comm_lanes!r} is invalid; choose "
                              f"one of {', '.join(COMM_LANES)}")
        if self.schedule not in SCHEDULERS:
            raise ConfigError(f"LayerSpec.schedule={self.schedule!r} is not a registered "
                              f"scheduler; choose one of {', '.join(sorted(SCHEDULERS))}")
        if self.recompute not in RECOMPUTES:
            raise ConfigError(f"LayerSpec.recompute={self.recompute!r} is invalid; choose one "
                              f"of {', '.join(RECOMPUTES)}")
        if (self.a2a == "node_dedup" and self.recompute == "full"
                and self.pipeline_degree > 1):
            # under the non-reentrant checkpoint the saved-tensor hooks make node_dedup's
            # backward autograd's mirror of the chunks' graphs (strategies/node_dedup/backward.py),
            # whose order over r > 1 chunks is autograd's, not a scheduler's
            raise ConfigError(f"LayerSpec.recompute='full' with a2a='node_dedup' and "
                              f"pipeline_degree={self.pipeline_degree} is not modelled (the "
                              "checkpointed backward is autograd's mirror of the chunks, in "
                              "autograd's order): use pipeline_degree=1 or recompute='none' / "
                              "'moe_act'")
        if self.dtype not in _BYTES:
            raise ConfigError(f"LayerSpec.dtype={self.dtype!r} is invalid; choose one of "
                              f"{', '.join(_BYTES)}")
        if self.structure not in STRUCTURES:
            raise ConfigError(f"LayerSpec.structure={self.structure!r} is invalid; choose one "
                              f"of {', '.join(STRUCTURES)}")
        # the widths as the layer computes them, from its own MoEConfig (which also checks
        # downscale_factor against d_model and d_expert, naming the field)
        cfg = MoEConfig(d_model=self.d_model, d_expert=self.d_expert,
                        num_experts=self.num_experts, top_k=self.top_k,
                        capacity_factor=self.capacity_factor, activation=self.activation,
                        structure=self.structure, downscale_factor=self.downscale_factor)
        object.__setattr__(self, "_widths", (comm_width(cfg), expert_hidden(cfg)))

    @property
    def width(self) -> int:
        """Columns a routed row carries through permute, the all-to-alls and combine
        (:func:`~moeflow.experts.structure.comm_width`: ``r * d_model`` for BigMac)."""
        return self._widths[0]

    @property
    def hidden(self) -> int:
        """An expert's hidden width (:func:`~moeflow.experts.structure.expert_hidden`:
        ``d_expert / r`` for BigMac's reversed experts, Eq. 4)."""
        return self._widths[1]

    @property
    def dcca(self) -> bool:
        """BigMac's descend / ascend projections sit around the exchange (Eq. 2)."""
        return self.structure == "bigmac"

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def elem_bytes(self) -> int:
        return _BYTES[self.dtype]

    def pass_codec(self, phase: str):
        """The codec of a pass's payloads (the backward's is ``none`` unless
        ``codec_backward``, as :class:`moeflow.layer.MoELayer` builds them; a recomputed
        forward uses the forward's)."""
        name = self.codec if phase != "backward" or self.codec_backward else "none"
        return registry("codec")[name]()

    def wire_row_bytes(self, phase: str) -> int:
        """Bytes one routed row (``width`` columns) takes on the wire in a pass: the codec's own
        size function (``Codec.wire_bytes``), per row (every codec's size is linear in rows)."""
        return int(self.pass_codec(phase).wire_bytes(1, self.width, _TORCH[self.dtype]))


def count_matrix(spec: LayerSpec, routing: list | None = None) -> np.ndarray:
    """``N[p][e]``: rows rank p sends to expert e (:class:`moeflow.dispatch.DispatchPlan`'s
    ``counts``). ``routing``: per rank, the ``(tokens, top_k)`` expert ids of one call, planned
    by :func:`~moeflow.dispatch.plan.make_plan` as the layer plans them; None: the uniform
    expectation (``tokens x top_k`` choices spread evenly over the experts)."""
    E, k, T, W = spec.num_experts, spec.top_k, spec.tokens, spec.world
    cap = None if spec.capacity_factor is None else capacity(T, k, E, spec.capacity_factor)
    if routing is None:
        even = np.full(E, (T * k) // E, dtype=np.int64)
        even[: (T * k) % E] += 1
        row = even if cap is None else (np.minimum(even, cap) if spec.trim_padding
                                        else np.full(E, cap, dtype=np.int64))
        return np.tile(row, (W, 1))
    if len(routing) != W:
        raise ConfigError(f"the routing sample has {len(routing)} ranks; the layout has {W}")
    rows = []
    for ids in routing:
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
        plan = make_plan(ids, E, cap, trim=cap is not None and spec.trim_padding)
        if cap is None:
            rows.append(plan.local_counts.numpy())
        elif plan.host_counts is not None:
            rows.append(np.asarray(plan.host_counts))
        else:
            rows.append(np.full(E, cap, dtype=np.int64))
    return np.stack(rows).astype(np.int64)


def chunk_matrices(spec: LayerSpec, counts: np.ndarray) -> list[np.ndarray]:
    """Per chunk, the split matrix ``S[src][dst]`` in rows (:class:`ChunkPlan`'s ``matrix``)."""
    W, e_local = spec.world, spec.num_experts // spec.world
    return [c.reshape(W, W, e_local).sum(2) for c in chunk_counts(counts, spec.pipeline_degree)]


def count_width(spec: LayerSpec, fssdp: bool = False) -> int:
    """int64 values each rank puts in the count exchange: its per-expert counts, FSSDP's two
    measured times (KeptChoices' extras); node_dedup: per chunk, its choices per expert and
    its tokens per destination node, all r chunks' in one all-gather (``_trimmed_stage``)."""
    if spec.a2a == "node_dedup":
        return spec.pipeline_degree * (spec.num_experts + spec.nodes)
    return spec.num_experts + (2 if fssdp else 0)


def counts_seconds(spec: LayerSpec, costs: CostModel, fssdp: bool = False
                   ) -> tuple[float, str]:
    """The count matrix's exchange before the forward's first chunk
    (:func:`moeflow.dispatch.plan.exchange_counts`): an all-gather of every rank's per-expert
    counts (int64) over the EP group, on the computing thread."""
    if spec.world == 1:
        return 0.0, "self"
    cls = ("intra" if spec.nodes == 1 else "inter" if spec.ranks_per_node == 1 else "world")
    width = count_width(spec, fssdp)
    return costs.link(cls, "all_gather").predict(spec.world * width * 8), cls


def _pass_tasks(spec: LayerSpec, costs: CostModel, mats: list[np.ndarray], phase: str,
                lanes: dict, last: dict, dedup: tuple | None = None,
                fssdp: bool = False) -> None:
    """Queue one pass (forward, its recomputation, or backward) on every rank's lanes;
    ``last[rank]`` is the last computing task queued before it (the pass waits for it). A
    recomputed forward is the forward without the count exchange (the plan record's counts).
    ``dedup``: node_dedup's ``(NE, C)`` per chunk (:func:`.exchange.node_dedup_chunks`)."""
    # d: the routed rows' width (BigMac's r*M, Eq. 2), h: the expert hidden width (F/r, Eq. 4);
    # M: the tokens' width, which the router and BigMac's projections read
    W, d, h, B = spec.world, spec.width, spec.hidden, spec.elem_bytes
    M = spec.d_model
    r, T, E = spec.pipeline_degree, spec.tokens, spec.num_experts
    sched = SCHEDULERS[spec.schedule]()
    mats_fn = 3 if spec.activation == "swiglu" else 2
    fwd = phase != "backward"
    xphase = "forward" if fwd else "backward"        # what the exchange carries
    send_rows = sum(m.sum(1) for m in mats)           # per rank, rows of the send buffer
    # (kind, chunk) -> per rank, the collectives of that all-to-all; A2 is the way back
    # (the transposed matrix, AllToAll.start_combine), in both passes as the pipeline runs it
    codec = spec.pass_codec(phase)
    wire = spec.wire_row_bytes(phase)               # bytes per row on the wire
    # node_dedup: each chunk is a whole deduplicated exchange (its (NE, C)); the codec
    # encodes and decodes inside its lane tasks, around the inter-node hops (.exchange)
    chunk_dedup = (None if dedup is None else
                   [(NE, Cn, xphase, codec) for NE, Cn in dedup])
    a2a = {(kind, i): exchange_steps(spec, costs, m if kind == "A1" else m.T, kind == "A2",
                                     xphase, None if dedup is None else chunk_dedup[i], wire)
           for i, m in enumerate(mats) for kind in ("A1", "A2")}
    overlap = sched.overlap
    bounds = [(i * T) // r for i in range(r + 1)]     # node_dedup's chunks of tokens
    k = spec.top_k
    for p in range(W):
        # pipe: a thread's steps in flight on another process group, which the thread's next
        # task waits for (it blocks in their wait()), and an all-to-all's concurrent steps,
        # which its consumer (D) waits for
        join: dict[str, list[SimTask]] = {}
        also: dict[Task, list[SimTask]] = {}

        def add(name, seconds, size=0, deps=(), lane="compute", runs_on="compute", **kw):
            deps = list(deps) + join.pop(runs_on, [])
            t = SimTask(name, p, lane, runs_on, phase, seconds, deps, size=size, **kw)
            lanes.setdefault((p, runs_on), []).append(t)
            return t

        S = int(send_rows[p])

        def enc(rows: int) -> float:
            """ScheMoE Section 3.1: C compresses a chunk's payload, D decompresses it
            (node_dedup: inside its lane tasks instead)."""
            if dedup is not None:
                return 0.0
            return costs.codec_time(codec.name, rows * d * B, rows * wire)
        el = lambda nbytes: costs.compute_time("elementwise", nbytes)   # noqa: E731
        outer = []
        if fwd:
            outer.append(("route", costs.compute_time("gemm", 2 * T * M * E)
                          + el(4 * T * E * B), T * M))
            if spec.dcca:      # BigMac Eq. 2: z = x W_d before the dispatch (MoELayer.forward)
                outer.append(("descend", costs.compute_time("gemm", 2 * T * M * d), T * M))
            if dedup is None:
                outer.append(("permute", el(2 * S * d * B), S * d))
            else:       # node_dedup: each token once, its k gates beside it (NodeDedup.permute)
                outer.append(("permute", el(2 * T * (d + k) * B), T * (d + k)))
        else:
            if spec.dcca:      # y W_u's backward first: its input and weight gradients
                outer.append(("ascend", costs.compute_time("gemm_backward", 4 * T * d * M),
                              T * M))
            assemble = el(2 * S * d * B) if r > 1 else 0.0
            if dedup is None:
                outer.append(("combine", el(2 * S * d * B + T * d * B) + assemble, S * d))
            else:       # node_dedup combines inside its exchange: the chunks' split only
                outer.append(("combine", el(2 * T * d * B) if r > 1 else 0.0, T * d))
        for name, sec, size in outer:
            last[p] = add(name, sec, size, [last[p]] if last[p] else [])
        if phase == "forward":
            sec, link = counts_seconds(spec, costs, fssdp)
            width = count_width(spec, fssdp)
            last[p] = add("counts", sec, spec.world * width * 8, [last[p]], lane="comm",
                          collective="forward/counts", link=link)
        done: dict[Task, SimTask] = {}
        for task in sched.order(r):
            i = task.chunk
            send, recv = int(mats[i][p].sum()), int(mats[i][:, p].sum())
            if dedup is not None and task.kind in ("C1", "D2"):
                # node_dedup: C1 gathers the chunk's (token, node) pair rows (token and gates),
                # D2 sums each token's nodes' partial sums; backward the mirror (the chunk's
                # output gradient in, the send buffer's rows' gradient out)
                pairs, t_i = int(dedup[i][1][p].sum()), bounds[i + 1] - bounds[i]
                if task.kind == "C1":
                    size = pairs * (d + k) if fwd else t_i * d
                    sec = el(2 * pairs * (d + k) * B) if fwd else el(2 * t_i * d * B)
                else:
                    size = pairs * d if fwd else t_i * (d + k)
                    sec = el((2 * pairs + t_i) * d * B) if fwd else el(2 * t_i * (d + k) * B)
            elif task.kind == "C1":
                sec = (el(2 * send * d * B) if r > 1 else 0.0) + enc(send)
                size = send * d
            elif task.kind == "E":
                flops = 2 * recv * mats_fn * d * h
                sec = costs.compute_time("experts" if fwd else "experts_backward",
                                         flops if fwd else 2 * flops)
                # the experts rerun first (node_dedup's task E keeps its own graph: moe_act
                # does not apply; a full recompute reran the whole forward before)
                if not fwd and spec.recompute != "none" and dedup is None:
                    sec += costs.compute_time("experts", flops)
                size = recv * d
            else:                      # D1, C2 on the expert side, D2 back on the tokens' side
                rows = recv if task.kind in ("D1", "C2") else send
                sec, size = enc(rows), rows * d
            pred = task.predecessor()
            deps = [done[pred]] + also.get(pred, []) if pred is not None else [last[p]]
            t = add(str(task), sec, size, deps)
            done[task] = t
            if task.kind in ("C1", "C2"):
                a = Task("A1" if task.kind == "C1" else "A2", i)
                prev = t
                for st in a2a[(a.kind, i)][p]:
                    thread = "compute" if not overlap else "comm"
                    runs_on = (thread if not overlap or spec.comm_lanes == "thread"
                               else f"comm/{st.link}")
                    if st.local:         # node_dedup: codec / relay work of the lane task
                        prev = add(str(a), st.seconds, 0, [prev], runs_on=runs_on, lane="comm",
                                   link=st.link)
                        continue
                    kw = dict(lane="comm", collective=f"{phase}/{a}/{st.group}", link=st.link,
                              stage=st.stage, remote_bytes=st.remote_bytes)
                    if not st.concurrent:
                        prev = add(str(a), st.seconds, st.nbytes, [prev], runs_on=runs_on, **kw)
                        continue
                    # Pipe-A2A's Inter-Stream (ScheMoE Section 5, Eq. 16): PipeAllToAll.start
                    # issues both all_to_all_single async_op=True, on two process groups
                    # (intra_node_group, lane_group), then waits for both. Each process group
                    # has its own worker (gloo: its own threads and connections; NCCL: its own
                    # communicator and stream), so even from the one communication thread the
                    # two run at once; the thread is blocked until both have ended. So: the
                    # Intra-Stream is the thread's task (above), the Inter-Stream a task of
                    # the lane group's own lane that the thread issues with it (its deps and
                    # the thread's previous task) and that the thread's next task and the
                    # consumer D wait for. With a lane per link class it is the inter lane's.
                    if runs_on == thread:
                        before = lanes[(p, thread)][-2:-1]      # the thread's previous task
                        step = add(str(a), st.seconds, st.nbytes, prev.deps + before,
                                   runs_on="comm/lane_group", **kw)
                        join.setdefault(thread, []).append(step)
                    else:
                        step = add(str(a), st.seconds, st.nbytes, prev.deps, runs_on=runs_on,
                                   **kw)
                    also.setdefault(a, []).append(step)
                done[a] = prev
        tail = done[Task("D2", r - 1)]
        ends = [done[Task("D2", i)] for i in range(r)]
        if fwd:
            assemble = el(2 * S * d * B) if r > 1 else 0.0
            outer = [("combine", el(2 * S * d * B + T * d * B) + assemble, S * d)
                     if dedup is None else
                     ("combine", el(2 * T * d * B) if r > 1 else 0.0, T * d)]
            if spec.dcca:      # BigMac Eq. 2: y = (sum_i g_i E_i(z)) W_u after the combine
                outer.append(("ascend", costs.compute_time("gemm", 2 * T * d * M), T * d))
        else:
            outer = [("permute", el(2 * S * d * B), S * d) if dedup is None else
                     ("permute", el(2 * T * (d + k) * B), T * (d + k))]
            if spec.dcca:
                outer.append(("descend", costs.compute_time("gemm_backward", 4 * T * M * d),
                              T * d))
            outer.append(("route", costs.compute_time("gemm_backward", 4 * T * M * E)
                          + el(4 * T * E * B), T * M))
        deps = ends
        for name, sec, size in outer:
            tail = add(name, sec, size, deps)
            deps = [tail]
        last[p] = tail


def simulate_layer(spec: LayerSpec, costs: CostModel, routing: list | None = None,
                   fssdp: "fssdp_model.FSSDPSpec | None" = None) -> dict:
    """The predicted step (forward + backward) of ``spec``: step time (the slowest rank),
    forward / backward split, per-kind busy time, exposed communication, and every task's
    start / end per rank and lane (seconds from the step's start). ``fssdp``: HECATE's
    placement (:mod:`.fssdp`): the exchange runs over held slots, with spAG / spRS."""
    dedup, fp = None, None
    if fssdp is not None:
        if spec.a2a == "node_dedup":
            raise ConfigError("LayerSpec.a2a='node_dedup' cannot be combined with FSSDP in the "
                              "simulator (the library plans node_dedup over static experts); "
                              "use a2a='direct' or a hierarchical one")
        fp = fssdp_model.plan(spec, fssdp, routing)
        counts = fp["counts"]
    elif spec.a2a == "node_dedup":
        if routing is None:     # distinct nodes per token need ids: uniform draws, seed 0
            from moeflow.simulate.loads import sample_routing
            routing = sample_routing(np.full(spec.num_experts, 1.0 / spec.num_experts),
                                     spec.world, spec.tokens, spec.top_k)
        # per chunk of consecutive tokens, the kept choices per expert and the (token, node)
        # pairs, as the library's trimmed exchange gathers them (its padded capacity layout,
        # capacity_padding="pad" or "auto" on a GPU, is modelled as trimmed)
        dedup = node_dedup_chunks(spec, routing)
        counts = sum(NE for NE, _ in dedup)
    else:
        counts = count_matrix(spec, routing)
    # FSSDP: held slot v = d * slots + j plays a global expert's role (token_plan.py)
    if dedup is not None:       # each chunk's split matrix, from its own choices per expert
        mats = [NE.reshape(spec.world, spec.world, -1).sum(2) for NE, _ in dedup]
    else:
        mats = chunk_matrices(spec if fp is None else
                              replace(spec, num_experts=spec.world * fp["slots"]), counts)
    rank_rows = counts.sum(0).reshape(spec.world, -1).sum(1)
    lanes: dict = {}
    for p in range(spec.world):
        for lane in ("compute", "comm", "comm/intra", "comm/inter"):
            lanes[(p, lane)] = []
    last = {p: None for p in range(spec.world)}
    if fp is not None:          # spAG(P, P') before the layer (Section 3.2)
        _sparse_tasks(spec, costs, fp, "spAG", "forward", lanes, last)
    _pass_tasks(spec, costs, mats, "forward", lanes, last, dedup, fssdp=fp is not None)
    if spec.recompute == "full":    # the checkpoint's rerun; FSSDP: spAG of the recorded P'
        if fp is not None:
            _sparse_tasks(spec, costs, fp, "spAG", "recompute", lanes, last)
        _pass_tasks(spec, costs, mats, "recompute", lanes, last, dedup, fssdp=fp is not None)
    elif fp is not None and fssdp.rematerialize:      # HECATE-RM: the second spAG
        _sparse_tasks(spec, costs, fp, "spAG", "backward", lanes, last)
    _pass_tasks(spec, costs, mats, "backward", lanes, last, dedup, fssdp=fp is not None)
    if fp is not None:          # spRS(P', P): the copies' gradients to the owners
        _sparse_tasks(spec, costs, fp, "spRS", "backward", lanes, last)
    step = engine.run(lanes)
    tasks = [t for v in lanes.values() for t in v]
    fwd_end = max(t.end for t in tasks if t.phase == "forward")
    recompute = [t for t in tasks if t.phase == "recompute"]
    rec_s = (max(t.end for t in recompute) - fwd_end) if recompute else 0.0
    busy: dict[str, float] = {}
    slowest = max(range(spec.world), key=lambda p: last[p].end)
    for t in tasks:
        if t.rank == slowest:
            kind = t.name.split("^")[0]
            busy[kind] = busy.get(kind, 0.0) + (t.end - t.start)
    # time with a collective of the slowest rank in flight: the union of its communication
    # tasks (pipe's two streams, or lanes per link class, overlap; busy_s adds them up)
    comm, until = 0.0, -np.inf
    for t in sorted((t for t in tasks if t.rank == slowest and t.lane == "comm"),
                    key=lambda t: t.start):
        comm += max(0.0, t.end - max(t.start, until))
        until = max(until, t.end)
    compute = sum(v for k, v in busy.items() if k not in COMM_TASKS)
    return {"spec": asdict(spec), "world": spec.world, "step_s": step,
            "forward_s": fwd_end, "backward_s": step - fwd_end,
            "recompute_s": rec_s,       # of backward_s: the rerun forward (full recompute)
            "busy_s": busy, "comm_s": comm, "compute_s": compute,
            # the slowest rank's computing lane not computing: waiting for communication
            "exposed_comm_s": max(0.0, step - compute),
            "counts": counts.tolist(),
            # rows each rank's experts receive (task E's input over the chunks), and the
            # heaviest rank's over the mean: the imbalance the critical path carries
            "expert_rows": [int(v) for v in rank_rows],
            "load_max_over_mean": (float(rank_rows.max() / rank_rows.mean())
                                   if rank_rows.sum() else 1.0),
            # the routed rows' width: d_model, or BigMac's r * d_model (Eq. 2)
            "width": spec.width, "expert_hidden": spec.hidden,
            "a2a_bytes": {f"{k}^{i + 1}": [int(v) for v in
                                           ((m.sum(1) if k == "A1" else m.sum(0))
                                            * spec.width * spec.elem_bytes)]
                          for i, m in enumerate(mats) for k in ("A1", "A2")},
            # per rank, bytes put on inter-node links, forward + backward (the layer's
            # stats["inter_node_bytes"]), and per all-to-all step the bytes each rank sends
            "inter_node_bytes": [sum(t.remote_bytes for t in tasks if t.rank == p)
                                 for p in range(spec.world)],
            "step_bytes": _step_bytes(tasks, spec.world),
            **({} if fp is None else {"fssdp": {
                "holders": [sorted(h) for h in fp["placement"].holders],
                "slots": fp["slots"], "spag_send_bytes": fp["spag_send_bytes"],
                "sprs_send_bytes": fp["sprs_send_bytes"]}}),
            "tasks": sorted((t.record() for t in tasks),
                            key=lambda rec: (rec["rank"], rec["start_s"]))}


def _sparse_tasks(spec: LayerSpec, costs: CostModel, fp: dict, name: str, phase: str,
                  lanes: dict, last: dict) -> None:
    """spAG or spRS on every rank's computing thread, one step of all ranks together."""
    if spec.world == 1:
        return
    p1 = fp["placement"]
    if name == "spAG":
        send, recv, owner = fp["spag_send_bytes"], fp["replica_bytes"], True
    else:
        send, owner = fp["sprs_send_bytes"], False
        recv = [0] * spec.world        # an owner receives each replica's copy
        for e, h in enumerate(p1.holders):
            recv[p1.owners[e]] += (len(h) - 1) * fp["expert_bytes"]
    sec = fssdp_model.sparse_seconds(spec, costs, p1, send, recv, owner)
    for p in range(spec.world):
        t = SimTask(name, p, "comm", "compute", phase, sec, [last[p]] if last[p] else [],
                    collective=f"{phase}/{name}", size=int(send[p]), stage=name)
        lanes[(p, "compute")].append(t)
        last[p] = t


def _step_bytes(tasks: list[SimTask], world: int) -> dict[str, list[int]]:
    """``"<phase>/<task>/<stage>"`` (e.g. ``forward/A1^1/inter``) -> bytes each rank sends."""
    out: dict[str, list[int]] = {}
    for t in tasks:
        if t.stage is not None:
            key = f"{t.phase}/{t.name}/{t.stage}"
            out.setdefault(key, [0] * world)[t.rank] += t.size
    return out


def lane_orders(result: dict, rank: int, phase: str) -> dict[str, list[str]]:
    """Task names per lane in the order they ran (ties in issue order): what the executor's
    :class:`~moeflow.schedule.executor.Timeline` records for the 7r tasks (one record per task:
    a lane task's successive steps, e.g. a hierarchical exchange's phases, are one entry)."""
    out: dict[str, list[str]] = {"compute": [], "comm": []}
    recs = [(rec["start_s"], n, rec) for n, rec in enumerate(result["tasks"])
            if rec["rank"] == rank and rec["phase"] == phase and "^" in rec["task"]]
    for _, _, rec in sorted(recs, key=lambda x: (x[0], x[1])):
        lane = out[rec["lane"]]
        if not lane or lane[-1] != rec["task"]:
            lane.append(rec["task"])
    return out
