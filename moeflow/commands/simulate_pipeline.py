"""``moeflow simulate train --pp N --pp-schedule S``: a pipeline-parallel training step of
``moeflow train --pp`` predicted from link and compute fits (docs/simulate.md, "Pipeline
parallelism").

The same checks as ``moeflow train --pp`` (:class:`~moeflow.config.TrainConfig` and
:func:`~moeflow.pipeline_parallel.check_pipeline`), the same split of the blocks into stages
(:mod:`moeflow.pipeline_parallel.split`), the same torch schedule class per ``--pp-schedule``
(:mod:`moeflow.pipeline_parallel.pipeline_schedules`, whose order
:mod:`moeflow.simulate.pipeline_order` reads), the same placement of the stages on the nodes
(:mod:`moeflow.pipeline_parallel.mesh`): each stage's MoE layers are simulated over the stage's
own EP group and its links, the stage-to-stage sends over the link between the two pipeline
ranks' nodes, and after the schedule the runner's once-per-step work (the gradient all-reduce
inside each stage group, the tied embedding's sum, the statistics and norm all-reduces over
the pipeline ranks, the optimizer).
"""

from __future__ import annotations

import argparse

from moeflow.errors import ConfigError
from moeflow.commands.simulate_common import zipf_routing
from moeflow.simulate.train_model import ACCUMULATE_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM


def add_pipeline_args(p) -> None:
    """``moeflow train``'s pipeline flags on ``simulate train``."""
    from moeflow.config import TrainConfig
    from moeflow.config.training import PP_LAYOUTS, PP_OVERLAPS, PP_SCHEDULES

    g = p.add_argument_group("pipeline parallelism (as `moeflow train`)")
    g.add_argument("--pp", type=int, default=TrainConfig.pp,
                   help="pipeline stages (1: none); the --grad-accum micro-batches are the "
                        "pipeline's, --batch-size sequences each per stage position")
    g.add_argument("--pp-schedule", default=TrainConfig.pp_schedule, choices=PP_SCHEDULES,
                   help="torch.distributed.pipelining's schedule; its own action order is "
                        "simulated")
    g.add_argument("--pp-layout", default=TrainConfig.pp_layout, choices=PP_LAYOUTS,
                   help="across-nodes: a stage is a block of consecutive ranks; within-nodes: "
                        "strided, each node holds whole pipelines")
    g.add_argument("--pp-overlap", default=TrainConfig.pp_overlap, choices=PP_OVERLAPS,
                   help="dualpipev's overlapped forward / backward pairs (auto: on with "
                        "dualpipev)")


def _refuse(msg: str) -> SystemExit:
    return SystemExit(f"moeflow simulate train: {msg}")


def _train_config(args: argparse.Namespace):
    from moeflow.config import TrainConfig

    return TrainConfig(batch_size=args.batch_size, grad_accum=args.grad_accum,
                       recompute=args.recompute, mp_size=args.mp, esp_size=args.esp,
                       ep_size=args.ep_size, pp=args.pp, pp_schedule=args.pp_schedule,
                       pp_layout=args.pp_layout, pp_overlap=args.pp_overlap,
                       eval_batches=args.grad_accum)


def stage_params(mcfg, blocks: range, first: bool, last: bool, ep: int,
                 holds_first: bool) -> tuple[int, int]:
    """(replicated, expert) parameters of one stage on one rank (``models.cost``'s counts
    per block): the blocks, the embeddings on the first stage, the final norm and, where the
    first stage is on another rank, the tied embedding's copy on the last."""
    from moeflow.experts.structure import comm_width, expert_hidden

    M, V = mcfg.d_model, mcfg.vocab_size
    dense = expert = 0
    for b in blocks:
        dense += 4 * M * M + 4 * M
        if mcfg.is_moe(b):
            moe = mcfg.moe_config(b)
            a = 3 if moe.activation == "swiglu" else 2
            w, h = comm_width(moe), expert_hidden(moe)     # BigMac: rM -> F/r -> rM
            bias = ((a - 1) * h + w) if moe.expert_bias else 0
            dense += M * moe.num_experts + (2 * M * w if moe.structure == "bigmac" else 0)
            expert += moe.num_experts // ep * (a * w * h + bias)
        else:
            dense += 2 * M * mcfg.d_ff
    if first:
        dense += V * M + mcfg.seq_len * M
    if last:
        dense += 2 * M + (0 if holds_first else V * M)
    return dense, expert


def _node(rank: int, per: int) -> int:
    return rank // per


def _pair_class(a: int, b: int, per: int) -> str:
    return "intra" if _node(a, per) == _node(b, per) else "inter"


def send_seconds(costs, pp: int, world: int, per: int, layout: str, nbytes: int
                 ) -> dict[tuple[int, int], float]:
    """Seconds of one activation (or gradient) of ``nbytes`` from pipeline rank ``a`` to
    ``b``: the p2p fit of the link between their nodes; across nodes, the stage positions
    whose sends leave the same node at once share its link (their bytes added)."""
    from moeflow.pipeline_parallel.mesh import global_rank

    size = world // pp
    out = {}
    for a in range(pp):
        for b in range(pp):
            if a == b:
                continue
            src, dst = global_rank(a, 0, world, pp, layout), global_rank(b, 0, world, pp, layout)
            cls = _pair_class(src, dst, per)
            flows = 1
            if cls == "inter":
                flows = sum(1 for s in range(size)
                            if _node(global_rank(a, s, world, pp, layout), per) == _node(src, per)
                            and _pair_class(global_rank(a, s, world, pp, layout),
                                            global_rank(b, s, world, pp, layout), per) == "inter")
            out[(a, b)] = costs.link(cls, "p2p").predict(nbytes * flows)
    return out


def _group_class(ranks: list[int], per: int) -> str:
    nodes = {_node(r, per) for r in ranks}
    if len(ranks) == 1:
        return "self"
    if len(nodes) == 1:
        return "intra"
    return "inter" if len(nodes) == len(ranks) else "world"


def after_schedule(costs, mcfg, tcfg, world: int, per: int, blocks: list[range],
                   ids_of: dict[int, list[int]], v_shape: bool) -> list[dict[str, float]]:
    """Per pipeline rank, the seconds of the runner's work after its schedule (position 0's
    groups): ``grad_sync`` (the replicated parameters all-reduced over the stage group; EP
    over the whole stage leaves no expert-data-parallel copy), ``tied_embedding`` (the first and
    last stage's copies summed, on different ranks), ``pp_all_reduce`` (the step's statistics,
    3 float64, and the global norm, 1 float32, over the pipeline ranks), ``grad_accumulate``
    and ``optimizer`` (memory traffic per local parameter, as
    :mod:`moeflow.simulate.train_model`)."""
    from moeflow.pipeline_parallel.mesh import global_rank

    pp, n = tcfg.pp, tcfg.grad_accum
    size = world // pp
    n_stages = len(blocks)
    stage_cls = _group_class([global_rank(0, s, world, pp, tcfg.pp_layout)
                              for s in range(size)], per)
    pp_cls = _group_class([global_rank(r, 0, world, pp, tcfg.pp_layout) for r in range(pp)], per)
    tie_cls = _group_class([global_rank(0, 0, world, pp, tcfg.pp_layout),
                            global_rank(pp - 1, 0, world, pp, tcfg.pp_layout)], per)
    out = []
    for r in range(pp):
        ids = ids_of[r]
        dense = expert = 0
        for sid in ids:
            d, e = stage_params(mcfg, blocks[sid], sid == 0, sid == n_stages - 1, size,
                                holds_first=0 in ids)
            dense, expert = dense + d, expert + e
        parts = {}
        if size > 1:
            parts["grad_sync"] = costs.link(stage_cls, "all_reduce").predict(dense * 4)
        if not v_shape and (0 in ids or n_stages - 1 in ids):
            parts["tied_embedding"] = costs.link(tie_cls, "all_reduce").predict(
                mcfg.vocab_size * mcfg.d_model * 4)
        parts["pp_all_reduce"] = (costs.link(pp_cls, "all_reduce").predict(24)
                                  + costs.link(pp_cls, "all_reduce").predict(4))
        if n > 1:
            parts["grad_accumulate"] = (n - 1) * costs.compute_time(
                "elementwise", ACCUMULATE_BYTES_PER_PARAM * (dense + expert))
        parts["optimizer"] = costs.compute_time("elementwise",
                                                OPTIMIZER_BYTES_PER_PARAM * (dense + expert))
        out.append(parts)
    return out


def run_pipeline(args: argparse.Namespace, mcfg, costs, nodes: int, per: int) -> dict:
    """The predicted ``moeflow train --pp`` step (one row)."""
    from moeflow.pipeline_parallel import check_pipeline
    from moeflow.pipeline_parallel.mesh import stage_ranks_per_node
    from moeflow.pipeline_parallel.overlap_fb import overlaps
    from moeflow.pipeline_parallel.pipeline_schedules import (SCHEDULE_CLASSES, VIRTUAL_STYLE,
                                                              num_stages, stage_ids,
                                                              stages_per_rank)
    from moeflow.pipeline_parallel.split import stage_blocks
    from moeflow.simulate import LayerSpec, simulate_layer
    from moeflow.simulate.pipeline_model import simulate_pipeline
    from moeflow.simulate.pipeline_order import torch_order
    from moeflow.simulate.pipeline_stages import StageSpec, stage_times

    world = nodes * per
    if args.compare is not None:
        raise _refuse(f"--compare {args.compare} with --pp {args.pp}: under pipeline "
                      "parallelism the MoE layers run plain expert parallelism only (as "
                      "`moeflow train --pp`); leave out --compare")
    if args.fssdp.strip() not in ("", "{}"):
        raise _refuse("--fssdp with --pp: FSSDP does not compose with pipeline parallelism "
                      "(as `moeflow train --pp`); leave out --fssdp or use --pp 1")
    if args.measured:
        raise _refuse("--measured with --pp: a `moeflow train --pp` run folder is not read as "
                      "a twin yet; compare with `moeflow bench pipeline`'s JSON "
                      "(docs/simulate.md, \"Pipeline parallelism\")")
    try:
        tcfg = _train_config(args)
        size = check_pipeline(mcfg, tcfg, world, per)
        stage_local = stage_ranks_per_node(world, tcfg.pp, per, tcfg.pp_layout)
    except ConfigError as e:
        raise _refuse(str(e)) from None
    if tcfg.ep_size not in (None, size):
        raise _refuse(f"--ep-size {tcfg.ep_size} with --pp {tcfg.pp}: expert-data-parallel "
                      f"copies inside a stage of {size} ranks are not modelled; use --ep-size "
                      f"{size} (the default: EP over the stage)")
    sched, pp, n = tcfg.pp_schedule, tcfg.pp, tcfg.grad_accum
    T = args.batch_size * mcfg.seq_len
    block = mcfg.moe_layer_ids()[0]
    moe = mcfg.moe_config(block)
    try:
        spec = LayerSpec(tokens=T, d_model=mcfg.d_model, d_expert=moe.d_expert,
                         num_experts=moe.num_experts, top_k=moe.top_k,
                         capacity_factor=moe.capacity_factor, activation=moe.activation,
                         schedule=moe.schedule, pipeline_degree=moe.pipeline_degree,
                         a2a=moe.a2a, nodes=size // stage_local, ranks_per_node=stage_local,
                         trim_padding=args.device == "cpu", codec=moe.codec,
                         codec_backward=moe.codec_backward, structure=moe.structure,
                         downscale_factor=moe.downscale_factor, dtype=args.dtype)
    except ConfigError as e:
        raise _refuse(f"the MoE layer of a stage ({size} ranks): {e}") from None
    routing, how = zipf_routing(args, spec, size, T)
    layer = simulate_layer(spec, costs, routing)
    n_stages = num_stages(sched, pp)
    blocks = stage_blocks(mcfg.n_layers, n_stages)
    times = [stage_times(StageSpec(T, mcfg.seq_len, mcfg.d_model, mcfg.n_heads, mcfg.d_ff,
                                   mcfg.vocab_size, tuple(mcfg.is_moe(b) for b in blk),
                                   s == n_stages - 1, spec.elem_bytes), costs, layer)
             for s, blk in enumerate(blocks)]
    order = torch_order(SCHEDULE_CLASSES[sched], pp, n, stages_per_rank(sched))
    sends = send_seconds(costs, pp, world, per, tcfg.pp_layout,
                         T * mcfg.d_model * spec.elem_bytes)
    overlap = overlaps(tcfg)
    res = simulate_pipeline(order, times, sends, overlap)
    ids_of = {r: stage_ids(sched, pp, r) for r in range(pp)}
    post = after_schedule(costs, mcfg, tcfg, world, per, blocks, ids_of,
                          VIRTUAL_STYLE.get(sched) == "v")
    post_s = max(sum(p.values()) for p in post)
    step = res["span_s"] + post_s
    for r, p in zip(res["ranks"], post):
        r["after_schedule_s"] = p
        # the MoE exchanges of the rank's blocks over the step (the layer model's comm time)
        r["moe_comm_s"] = n * layer["comm_s"] * sum(
            mcfg.is_moe(b) for sid in ids_of[r["rank"]] for b in blocks[sid])
    tokens = T * size * n
    return {"variant": f"pp{pp}:{sched}" + (f":{tcfg.pp_layout}"
                                            if tcfg.pp_layout != "across-nodes" else "")
            + ("" if sched != "dualpipev" else f":overlap={'on' if overlap else 'off'}"),
            "pp": pp, "pp_schedule": sched, "pp_layout": tcfg.pp_layout, "overlap": overlap,
            "micro_batches": n, "stage_ranks": size, "stage_ranks_per_node": stage_local,
            "routing": how, "step_s": step, "schedule_s": res["span_s"],
            "after_schedule_s": post_s, "bubble_mean": res["bubble_mean"],
            "ranks": res["ranks"], "tokens_per_step": tokens, "tokens_per_s": tokens / step,
            "stages": [{"blocks": list(b), "forward_s": t.forward_s, "input_s": t.input_s,
                        "weight_s": t.weight_s} for b, t in zip(blocks, times)],
            "sends_s": {f"{a}->{b}": s for (a, b), s in sends.items()},
            "moe_layer": {k: layer[k] for k in ("step_s", "forward_s", "backward_s", "comm_s",
                                                "exposed_comm_s")},
            "order": {r: [str(a) for a in acts] for r, acts in order.items()},
            "actions": res["actions"]}


def format_pipeline(row: dict, label: str, world: int) -> str:
    lines = [f"moeflow train {label} --pp {row['pp']} --pp-schedule {row['pp_schedule']} "
             f"--pp-layout {row['pp_layout']} on {world} ranks ({row['stage_ranks']} per stage, "
             f"{row['micro_batches']} micro-batches), one step (predicted)",
             f"step {row['step_s'] * 1e3:.2f} ms = schedule {row['schedule_s'] * 1e3:.2f} ms + "
             f"after it {row['after_schedule_s'] * 1e3:.2f} ms; bubble (mean of the pipeline "
             f"ranks) {row['bubble_mean']:.3f}; {row['tokens_per_s']:.0f} tok/s"
             + ("; overlapped pairs" if row["overlap"] else "")]
    head = f"{'pp rank':>7} {'busy ms':>9} {'idle ms':>9} {'bubble':>7} {'sends ms':>9} " \
           f"{'after ms':>9}"
    lines += [head, "-" * len(head)]
    for r in row["ranks"]:
        lines.append(f"{r['rank']:>7} {r['busy_s'] * 1e3:>9.2f} {r['idle_s'] * 1e3:>9.2f} "
                     f"{r['bubble']:>7.3f} {r['send_s'] * 1e3:>9.2f} "
                     f"{sum(r['after_schedule_s'].values()) * 1e3:>9.2f}")
    st = ", ".join(f"{i}: F {s['forward_s'] * 1e3:.2f} I {s['input_s'] * 1e3:.2f} "
                   f"W {s['weight_s'] * 1e3:.2f}" for i, s in enumerate(row["stages"]))
    lines.append(f"stage chunk ms (one micro-batch) {st}; sends ms "
                 + ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in row["sends_s"].items()))
    lines.append("busy: the rank's chunks; idle: the schedule's span minus busy (waiting for "
                 "inputs, the bubble); after: gradient all-reduces, the tied embedding, the "
                 "optimizer; tok/s: tokens per step / step")
    return "\n".join(lines)


__all__ = ["add_pipeline_args", "after_schedule", "format_pipeline", "run_pipeline",
           "send_seconds", "stage_params"]
