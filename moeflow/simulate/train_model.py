"""A whole training step of the MoE GPT in the simulator (``moeflow simulate train``).

One optimizer step of :class:`moeflow.models.gpt.GPT` on ``grad_accum`` micro-batches per rank
(one by default), as the sequence of what each rank runs (the blocks run one after the other,
so their times add):

* the embedding, and per block the attention (``8 T M^2`` GEMM FLOPs for q, k, v and the
  output projection, ``4 T S M`` for the scores and the weighted sum, over the full sequence as
  :mod:`moeflow.models.cost` counts them; two LayerNorms, the softmax and the residual adds as
  memory traffic), then either the dense FFN (``4 T M d_ff``) or the MoE layer, simulated by
  :mod:`.layer` / :mod:`.parm` / :mod:`.fssdp` (its predicted forward + backward: the slowest
  rank's), and the LM head (``2 T M V``) with its cross-entropy; backward GEMMs at twice the
  forward FLOPs (the ``gemm_backward`` fit), elementwise work twice;
* with tensor parallelism (``mp > 1``, Parm's MP / Megatron's scheme in
  :mod:`moeflow.parallel.tensor_parallel`) the attention and dense FFN GEMMs are split over the
  MP group and each row-parallel layer all-reduces its ``T x M`` output (forward) and each
  column-parallel layer its input gradient (backward), on the MP group's link;
* the gradient synchronisation (:func:`moeflow.parallel.grad_sync.sync_gradients`): the
  replicated parameters' gradients all-reduced over their data-parallel group, the experts'
  over their expert-data-parallel group (none when EP spans the world), each as one all-reduce
  of the whole buffer (the library buckets them; the alpha of every bucket but one is not
  counted);
* the optimizer step (AdamW) as memory traffic: 28 bytes per local parameter (parameter,
  gradient and two moments read, parameter and moments written, fp32): an assumption of this
  model, not a measurement.

Gradient accumulation (``grad_accum = N``, ``TrainConfig.grad_accum``): the forward and backward
of every part above run N times, once per micro-batch of ``tokens``
(:func:`moeflow.trainer.accumulate_gradients`; the MoE layers' all-to-alls, Parm's ESP
collectives and FSSDP's spAG / spRS are per forward, so per micro-batch); autograd adds the
micro-batches' gradients into ``.grad`` (the ``grad_accumulate`` part: 12 bytes per local
parameter for each micro-batch after the first, an in-place add, as memory traffic: an
assumption of this model); the gradient sync and the optimizer step run once per step
(``Trainer.train_step``: ``sync_gradients`` after the last micro-batch, "once per optimizer
step"; docs/training.md, "Gradient accumulation").

Recomputation (``recompute``, ``TrainConfig.recompute``; docs/training.md, "Activation
recomputation"): ``full`` runs every block under non-reentrant ``torch.utils.checkpoint``
(:class:`moeflow.models.gpt.GPT`, ``checkpoint_blocks``; the embedding and the LM head are
outside the blocks), so the backward reruns each block's forward: the attention and dense FFN
forward GEMMs and elementwise work and, with MP, their forward all-reduces (the ``recompute``
part); the MoE layers' rerun (all-to-alls re-sent, counts replayed) is in their simulated
step (:mod:`.layer`, :mod:`.parm`). ``moe_act`` changes the MoE layers only (their backward
task E reruns the experts).

Compute times come from ``moeflow bench compute`` fits (``gemm``, ``gemm_backward``,
``elementwise``) or a profile's datasheet; collectives from ``moeflow bench links`` fits or the
profile. Not modelled: overlap of the gradient all-reduce with the backward, gradient clipping's
norm all-reduce, the trainer's per-step bookkeeping (the preemption flag's all-reduce, the batch
draw), dropout, FSDP2 on the dense part.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moeflow.errors import ConfigError
from moeflow.simulate.costs import CostModel
from moeflow.simulate.layer_model import RECOMPUTES

OPTIMIZER_BYTES_PER_PARAM = 28      # AdamW, fp32: 4 reads + 3 writes of 4 bytes (assumed)
ACCUMULATE_BYTES_PER_PARAM = 12     # .grad += g, fp32: 2 reads + 1 write of 4 bytes (assumed)
# the parts that run once per micro-batch (times grad_accum); the others once per step
MICRO_BATCH_PARTS = ("attention", "dense_ffn", "embed_head", "mp_all_reduce", "recompute",
                     "moe_layers")


@dataclass(frozen=True)
class TrainSpec:
    """The dense part of one rank's step: ``tokens = batch x seq_len`` per rank and micro-batch
    (per MP group with tensor parallelism), ``grad_accum`` micro-batches per step, the
    recomputation mode, and the parameter counts the gradient sync moves."""

    tokens: int
    seq_len: int
    d_model: int
    n_heads: int
    d_ff: int
    vocab_size: int
    n_layers: int
    moe_blocks: tuple[int, ...]
    dense_params: int              # replicated (or MP-sharded) parameters of one rank
    expert_params: int             # expert parameters one rank holds
    dp_size: int                   # ranks the dense gradients are averaged over
    expert_dp_size: int            # ranks an expert's gradient is averaged over
    mp: int = 1
    nodes: int = 1
    ranks_per_node: int = 1
    elem_bytes: int = 4
    grad_accum: int = 1            # micro-batches per optimizer step (TrainConfig.grad_accum)
    recompute: str = "none"        # TrainConfig.recompute: none, full, moe_act

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTES:
            raise ConfigError(f"TrainSpec.recompute={self.recompute!r} is invalid; choose one "
                              f"of {', '.join(RECOMPUTES)}")
        for name in ("tokens", "seq_len", "d_model", "n_heads", "d_ff", "vocab_size",
                     "n_layers", "dp_size", "expert_dp_size", "mp", "nodes", "ranks_per_node",
                     "grad_accum"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"TrainSpec.{name}={v!r} is invalid: a positive integer")
        if any(not 0 <= b < self.n_layers for b in self.moe_blocks):
            raise ConfigError(f"TrainSpec.moe_blocks={self.moe_blocks} is invalid: blocks are "
                              f"0..{self.n_layers - 1}")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


def _link_class(spec: TrainSpec, size: int, consecutive: bool = True) -> str:
    """The link class of a group of ``size`` ranks (MP: consecutive ranks; the data-parallel
    groups: strided ones)."""
    L = spec.ranks_per_node
    if size == 1:
        return "self"
    if consecutive and size <= L:
        return "intra"
    if spec.nodes == 1:
        return "intra"
    return "inter" if L == 1 else "world"


def dense_seconds(spec: TrainSpec, costs: CostModel) -> dict[str, float]:
    """Seconds of the dense work of one micro-batch per part (forward + backward); with
    ``recompute="full"`` the blocks' forward once more (``recompute``)."""
    T, S, M, B, mp = spec.tokens, spec.seq_len, spec.d_model, spec.elem_bytes, spec.mp
    gf = lambda f: costs.compute_time("gemm", f)                  # noqa: E731: forward
    g = lambda f: gf(f) + costs.compute_time("gemm_backward", 2 * f)  # noqa: E731
    ef = lambda b: costs.compute_time("elementwise", b)           # noqa: E731: forward
    el = lambda b: 3 * ef(b)                                      # noqa: E731: fwd + 2x bwd
    n_dense = spec.n_layers - len(spec.moe_blocks)
    att = (8 * T * M * M / mp, 4 * T * S * M / mp)                # GEMM FLOPs of a block
    att_bytes = 2 * 2 * T * M * B + 2 * T * spec.n_heads * S * B / mp + 2 * 3 * T * M * B
    ffn_flops, ffn_bytes = 4 * T * M * spec.d_ff / mp, 2 * T * spec.d_ff * B / mp
    attention = spec.n_layers * (g(att[0]) + g(att[1]) + el(att_bytes))
    ffn = n_dense * (g(ffn_flops) + el(ffn_bytes))
    head = g(2 * T * M * spec.vocab_size) + el(3 * T * spec.vocab_size * B + 2 * T * M * B)
    out = {"attention": attention, "dense_ffn": ffn, "embed_head": head}
    per = 0.0
    if mp > 1:      # Megatron's g (forward) and f (backward): T x M over the MP group
        per = costs.link(_link_class(spec, mp), "all_reduce").predict(T * M * B)
        out["mp_all_reduce"] = 2 * (spec.n_layers + n_dense) * per
    if spec.recompute == "full":      # the checkpointed blocks' forward, again in backward
        out["recompute"] = (spec.n_layers * (gf(att[0]) + gf(att[1]) + ef(att_bytes))
                            + n_dense * (gf(ffn_flops) + ef(ffn_bytes))
                            + (spec.n_layers + n_dense) * per)
    return out


def sync_seconds(spec: TrainSpec, costs: CostModel) -> dict[str, float]:
    """The gradient all-reduces (dense over ``dp_size``, experts over ``expert_dp_size``) and
    the optimizer's memory traffic."""
    out = {}
    if spec.dp_size > 1:
        cls = _link_class(spec, spec.dp_size, consecutive=spec.mp == 1)
        out["grad_sync"] = costs.link(cls, "all_reduce").predict(spec.dense_params * 4)
    if spec.expert_dp_size > 1:
        cls = _link_class(spec, spec.expert_dp_size, consecutive=False)
        out["grad_sync"] = out.get("grad_sync", 0.0) + costs.link(cls, "all_reduce").predict(
            spec.expert_params * 4)
    out["optimizer"] = costs.compute_time(
        "elementwise", OPTIMIZER_BYTES_PER_PARAM * (spec.dense_params + spec.expert_params))
    return out


def simulate_train(spec: TrainSpec, costs: CostModel, moe: dict[int, dict]) -> dict:
    """The predicted step: ``moe[block]`` is that block's simulated MoE layer (a
    :func:`~moeflow.simulate.layer_model.simulate_layer` / ``simulate_parm`` result, simulated with
    the step's recomputation mode). ``parts_s`` are per step: the micro-batch parts
    (:data:`MICRO_BATCH_PARTS`) ``grad_accum`` times, the gradient sync and the optimizer
    once."""
    missing = sorted(set(spec.moe_blocks) - set(moe))
    if missing:
        raise ConfigError(f"simulate_train: no simulated MoE layer for blocks {missing}")
    n = spec.grad_accum
    micro = dense_seconds(spec, costs)
    micro["moe_layers"] = sum(moe[b]["step_s"] for b in spec.moe_blocks)
    parts = {k: n * v for k, v in micro.items()}
    if n > 1:
        parts["grad_accumulate"] = (n - 1) * costs.compute_time(
            "elementwise", ACCUMULATE_BYTES_PER_PARAM * (spec.dense_params + spec.expert_params))
    parts.update(sync_seconds(spec, costs))
    step = sum(parts.values())
    moe_comm = sum(moe[b]["comm_s"] for b in spec.moe_blocks)
    return {"spec": asdict(spec), "step_s": step, "parts_s": parts,
            "micro_batch_s": sum(micro.values()),
            "moe_comm_s": n * moe_comm, "moe_exposed_comm_s": n * sum(
                moe[b]["exposed_comm_s"] for b in spec.moe_blocks),
            "tokens_per_s": spec.tokens * spec.dp_size * n / step if step else 0.0}


__all__ = ["ACCUMULATE_BYTES_PER_PARAM", "MICRO_BATCH_PARTS", "OPTIMIZER_BYTES_PER_PARAM",
           "TrainSpec", "dense_seconds", "simulate_train", "sync_seconds"]
