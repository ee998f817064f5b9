"""A whole training step of the MoE GPT in the simulator (``moeflow simulate train``).

One optimizer step of :class:`moeflow.models.gpt.GPT` on one micro-batch per rank, as the
sequence of what each rank runs (the blocks run one after the other, so their times add):

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

Compute times come from ``moeflow bench compute`` fits (``gemm``, ``gemm_backward``,
``elementwise``) or a profile's datasheet; collectives from ``moeflow bench links`` fits or the
profile. Not modelled: gradient accumulation's extra micro-batches (each would repeat the
forward and backward), activation recomputation, overlap of the gradient all-reduce with the
backward, dropout, FSDP2 on the dense part.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moeflow.errors import ConfigError
from moeflow.simulate.costs import CostModel

OPTIMIZER_BYTES_PER_PARAM = 28      # AdamW, fp32: 4 reads + 3 writes of 4 bytes (assumed)


@dataclass(frozen=True)
class TrainSpec:
    """The dense part of one rank's step: ``tokens = batch x seq_len`` per rank (per MP group
    with tensor parallelism) and the parameter counts the gradient sync moves."""

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

    def __post_init__(self) -> None:
        for name in ("tokens", "seq_len", "d_model", "n_heads", "d_ff", "vocab_size",
                     "n_layers", "dp_size", "expert_dp_size", "mp", "nodes", "ranks_per_node"):
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
    """Seconds of the dense work of one step per part (forward + backward)."""
    T, S, M, B, mp = spec.tokens, spec.seq_len, spec.d_model, spec.elem_bytes, spec.mp
    g = lambda f: costs.compute_time("gemm", f) + costs.compute_time("gemm_backward", 2 * f)  # noqa: E731
    el = lambda b: 3 * costs.compute_time("elementwise", b)      # noqa: E731: fwd + 2x bwd
    n_dense = spec.n_layers - len(spec.moe_blocks)
    attention = spec.n_layers * (
        g(8 * T * M * M / mp) + g(4 * T * S * M / mp)
        + el(2 * 2 * T * M * B + 2 * T * spec.n_heads * S * B / mp + 2 * 3 * T * M * B))
    ffn = n_dense * (g(4 * T * M * spec.d_ff / mp) + el(2 * T * spec.d_ff * B / mp))
    head = g(2 * T * M * spec.vocab_size) + el(3 * T * spec.vocab_size * B + 2 * T * M * B)
    out = {"attention": attention, "dense_ffn": ffn, "embed_head": head}
    if mp > 1:      # Megatron's g (forward) and f (backward): T x M over the MP group
        per = costs.link(_link_class(spec, mp), "all_reduce").predict(T * M * B)
        out["mp_all_reduce"] = 2 * (spec.n_layers + n_dense) * per
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
    :func:`~moeflow.simulate.layer.simulate_layer` / ``simulate_parm`` result)."""
    missing = sorted(set(spec.moe_blocks) - set(moe))
    if missing:
        raise ConfigError(f"simulate_train: no simulated MoE layer for blocks {missing}")
    parts = dense_seconds(spec, costs)
    parts["moe_layers"] = sum(moe[b]["step_s"] for b in spec.moe_blocks)
    parts.update(sync_seconds(spec, costs))
    step = sum(parts.values())
    moe_comm = sum(moe[b]["comm_s"] for b in spec.moe_blocks)
    return {"spec": asdict(spec), "step_s": step, "parts_s": parts,
            "moe_comm_s": moe_comm, "moe_exposed_comm_s": sum(
                moe[b]["exposed_comm_s"] for b in spec.moe_blocks),
            "tokens_per_s": spec.tokens * spec.dp_size / step if step else 0.0}


__all__ = ["OPTIMIZER_BYTES_PER_PARAM", "TrainSpec", "dense_seconds", "simulate_train",
           "sync_seconds"]
