"""The chunk times of one pipeline stage of the MoE GPT (``moeflow simulate train --pp``): a
stage's consecutive blocks on one micro-batch, forward (``F``), backward of the input
(``I``) and of the weights (``W``), with the same per-block work as :mod:`.train_model`
(attention, dense FFN, the LM head with its cross-entropy on the last stage; backward GEMMs
from the ``gemm_backward`` fit at twice the forward FLOPs, elementwise work twice) and each MoE
layer's simulated forward and backward (:mod:`.layer_model`, over the stage's own
expert-parallel group: Narayanan et al. 2021 Section 2.3, the other parallelisms inside a
stage).

The zero-bubble schedules split a backward into ``I`` and ``W`` (Qi et al. 2024 Section 2): a
stage without MoE layers splits every weight GEMM's backward in two halves (the input's and the
weight's gradient, the same FLOPs each), the attention scores' GEMMs (no weights) and the
elementwise work going to ``I``; a stage with MoE layers computes both in its ``I`` step and its
``W`` is empty (``moeflow train --pp`` runs the MoE layers' exchanges' backward once:
docs/training.md, "Pipeline parallelism").

The segments (compute ``c`` / MoE exchange ``x``, in order) of the forward and of the full
backward are what an overlapped DualPipeV pair interleaves (:mod:`.pipeline_model`); an MoE
layer's are read off its simulated timeline (one rank's tasks in time order, the wait before a
task counted with it).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.errors import ConfigError
from moeflow.simulate.costs import CostModel
from moeflow.simulate.layer_model import COMM_TASKS
from moeflow.simulate.pipeline_model import Segments, StageTimes


@dataclass(frozen=True)
class StageSpec:
    """One stage: its blocks in order (``blocks[i]``: block i has an MoE FFN, else a dense
    one); the head on the last stage; ``tokens`` per micro-batch (``batch x seq_len``)."""

    tokens: int
    seq_len: int
    d_model: int
    n_heads: int
    d_ff: int
    vocab_size: int
    blocks: tuple[bool, ...]
    is_last: bool
    elem_bytes: int = 4

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ConfigError("StageSpec.blocks=() is invalid: a stage has at least one block")

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def moe_blocks(self) -> int:
        return sum(map(bool, self.blocks))


def layer_segments(layer: dict, phase: str, rank: int = 0) -> Segments:
    """One rank's tasks of an MoE layer's ``phase`` (forward / backward) in time order as
    compute / exchange segments; the time before a task (waiting) is counted with it."""
    tasks = sorted((t for t in layer["tasks"] if t["rank"] == rank and t["phase"] == phase),
                   key=lambda t: (t["start_s"], t["end_s"]))
    if not tasks:
        raise ConfigError(f"the MoE layer has no {phase} tasks on rank {rank}")
    cursor = layer["forward_s"] if phase == "backward" else 0.0
    out: list[tuple[str, float]] = []
    for t in tasks:
        if t["end_s"] <= cursor:
            continue
        comm = t["lane"] != "compute" or t["task"].split("^")[0] in COMM_TASKS
        kind = "x" if comm else "c"
        out.append((kind, t["end_s"] - cursor))
        cursor = t["end_s"]
    return _merge(out)


def _merge(segs) -> Segments:
    out: list[tuple[str, float]] = []
    for kind, s in segs:
        if s <= 0:
            continue
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + s)
        else:
            out.append((kind, s))
    return tuple(out)


def stage_times(spec: StageSpec, costs: CostModel, moe_layer: dict | None) -> StageTimes:
    """The stage's :class:`StageTimes` on one micro-batch; ``moe_layer``: the simulated MoE
    layer (required when the stage has MoE blocks)."""
    if spec.moe_blocks and moe_layer is None:
        raise ConfigError("stage_times: the stage has MoE blocks and no simulated MoE layer")
    T, S, M, B = spec.tokens, spec.seq_len, spec.d_model, spec.elem_bytes
    gf = lambda f: costs.compute_time("gemm", f)                # noqa: E731
    gb = lambda f: costs.compute_time("gemm_backward", 2 * f)   # noqa: E731: dX and dW
    ef = lambda b: costs.compute_time("elementwise", b)         # noqa: E731
    att_w, att_s = 8 * T * M * M, 4 * T * S * M     # projections (weights), scores (none)
    att_b = 2 * 2 * T * M * B + 2 * T * spec.n_heads * S * B + 2 * 3 * T * M * B
    ffn_w, ffn_b = 4 * T * M * spec.d_ff, 2 * T * spec.d_ff * B
    head_w, head_b = 2 * T * M * spec.vocab_size, 3 * T * spec.vocab_size * B + 2 * T * M * B
    # (forward, backward of the input, backward of the weights) of each dense piece
    att = (gf(att_w) + gf(att_s) + ef(att_b), gb(att_w) / 2 + gb(att_s) + 2 * ef(att_b),
           gb(att_w) / 2)
    ffn = (gf(ffn_w) + ef(ffn_b), gb(ffn_w) / 2 + 2 * ef(ffn_b), gb(ffn_w) / 2)
    head = (gf(head_w) + ef(head_b), gb(head_w) / 2 + 2 * ef(head_b), gb(head_w) / 2)
    n_dense = spec.n_blocks - spec.moe_blocks
    pieces = [att] * spec.n_blocks + [ffn] * n_dense + ([head] if spec.is_last else [])
    fwd = sum(p[0] for p in pieces)
    inp = sum(p[1] for p in pieces)
    wgt = sum(p[2] for p in pieces)
    f_segs: list[tuple[str, float]] = []
    b_segs: list[tuple[str, float]] = []
    if spec.moe_blocks:
        fwd += spec.moe_blocks * moe_layer["forward_s"]
        inp += spec.moe_blocks * moe_layer["backward_s"] + wgt     # W computed in I
        wgt = 0.0
        mf, mb = layer_segments(moe_layer, "forward"), layer_segments(moe_layer, "backward")
    for is_moe in spec.blocks:          # the segments, block by block
        f_segs.append(("c", att[0]))
        f_segs.extend(mf if is_moe else [("c", ffn[0])])
        b_segs[:0] = [*(mb if is_moe else [("c", ffn[1] + ffn[2])]),
                      ("c", att[1] + att[2])]
    if spec.is_last:
        f_segs.append(("c", head[0]))
        b_segs.insert(0, ("c", head[1] + head[2]))
    return StageTimes(fwd, inp, wgt, _merge(f_segs), _merge(b_segs))


__all__ = ["StageSpec", "layer_segments", "stage_times"]
