"""Parameters, FLOPs and all-to-all volume of the MoE GPT, per structure (BigMac Tables 3-4).

Counted for :class:`~moeflow.models.gpt.GPT` exactly as built (tied LM head, no biases in
attention/FFN/experts, LayerNorm weight + bias), so ``params_total`` equals
``sum(p.numel())`` of the model on one rank (tests check it). With ``M = d_model``,
``S = seq_len``, ``E`` experts, top-``k``, expert width ``F = d_expert``, ``r`` BigMac's
downscale factor, ``w = rM`` the communicated width (``M`` for vanilla / fine-grained), and
``a = 3`` for SwiGLU experts else ``2``:

* one MoE layer: experts ``a*E*M*F`` (BigMac: ``a*E*(rM)*(F/r)``, the same), router ``M*E``,
  BigMac's ``W_d, W_u``: ``2*r*M^2``;
* forward FLOPs per token (a multiply-add is 2 FLOPs): attention ``8M^2 + 4SM`` (QK^T and AV
  over the full sequence, no causal halving), MoE ``2ME + 2akMF`` (+ ``4rM^2`` for BigMac),
  dense FFN ``4 M d_ff``, LM head ``2MV``; training counts forward + backward as 3x forward;
* all-to-all elements per token and MoE layer: dispatch + combine, forward + backward =
  ``4*k*w``; with a capacity factor ``f`` the padded buffer makes it about ``4*f*k*w``
  (exactly ``4*E*ceil(f*k*T/E)*w/T`` for ``T`` local tokens, as
  ``moeflow.cases.structures.expected_a2a_bytes`` computes). Of these, a fraction
  ``(p-1)/p`` leaves the rank under uniform routing over ``p`` expert-parallel ranks.

With GPT3-XL (24 MoE layers, M 2048, 64 experts top-8, F 512, V 50257, S 2048, 2^19 tokens)
this gives 3.73B / 3.78B parameters, 3500 / 3658 TFLOPs and 1536 GiB / 384 GiB of all-to-all
(1488 / 372 GiB leaving the rank at EP 32): the paper's Table 4 reads 3.73B / 3.78B,
3490.67 / 3649.00 T and 1488 / 372 GB (see docs/benchmarks/bigmac.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.config import DEFAULT_DOWNSCALE_FACTOR, ConfigError, ModelConfig, config_error


@dataclass
class ModelCost:
    structure: str
    num_experts: int
    top_k: int
    d_expert: int
    expert_hidden: int
    comm_width: int
    capacity_factor: float | None
    params_total: int
    params_per_moe_layer: int
    params_active_per_token: int
    train_flops_per_token: float
    a2a_elems_per_token_layer: float        # fwd + bwd, dispatch + combine, one MoE layer
    a2a_bytes_per_token: float              # all MoE layers, at bytes_per_element
    a2a_offrank_bytes_per_token: float      # the (p-1)/p of it that leaves the rank
    bytes_per_element: int
    ep_size: int


def _widths(cfg: ModelConfig) -> tuple[int, int, float]:
    moe = cfg.moe
    r = 1.0 if moe.structure != "bigmac" else (
        DEFAULT_DOWNSCALE_FACTOR if moe.downscale_factor is None else float(moe.downscale_factor))
    return round(r * cfg.d_model), round(moe.d_expert / r), r


def model_cost(cfg: ModelConfig, bytes_per_element: int = 4, ep_size: int = 1) -> ModelCost:
    M, S, V = cfg.d_model, cfg.seq_len, cfg.vocab_size
    moe = cfg.moe
    E, k, F = moe.num_experts, moe.top_k, moe.d_expert
    a = 3 if _gated(moe.activation) else 2
    w, h, r = _widths(cfg)
    proj = 2 * M * w if moe.structure == "bigmac" else 0
    n_moe = cfg.num_moe_layers
    n_dense = cfg.n_layers - n_moe
    block_common = 4 * M * M + 4 * M                    # attention + two LayerNorms
    bias = ((a - 1) * h + w) if moe.expert_bias else 0     # b1 (and b3), b2 per expert
    moe_layer = a * E * w * h + E * bias + M * E + proj
    dense_ffn = 2 * M * cfg.d_ff
    params = (V * M + S * M + cfg.n_layers * block_common + n_moe * moe_layer
              + n_dense * dense_ffn + 2 * M)
    active = (V * M + S * M + cfg.n_layers * block_common + n_moe * (a * k * w * h + k * bias + M * E + proj)
              + n_dense * dense_ffn + 2 * M)
    fwd = (cfg.n_layers * (8 * M * M + 4 * S * M)
           + n_moe * (2 * M * E + 2 * a * k * w * h + 2 * proj)
           + n_dense * 2 * dense_ffn + 2 * M * V)
    f = 1.0 if moe.capacity_factor is None else float(moe.capacity_factor)
    elems = 4 * f * k * w
    total_bytes = n_moe * elems * bytes_per_element
    return ModelCost(structure=moe.structure, num_experts=E, top_k=k, d_expert=F,
                     expert_hidden=h, comm_width=w, capacity_factor=moe.capacity_factor,
                     params_total=params, params_per_moe_layer=moe_layer,
                     params_active_per_token=active, train_flops_per_token=3.0 * fwd,
                     a2a_elems_per_token_layer=elems, a2a_bytes_per_token=total_bytes,
                     a2a_offrank_bytes_per_token=total_bytes * (ep_size - 1) / ep_size,
                     bytes_per_element=bytes_per_element, ep_size=ep_size)


def structure_variants(cfg: ModelConfig, granularity: int = 4,
                       downscale_factor: float | None = None) -> list[ModelConfig]:
    """The same model as vanilla, fine-grained and BigMac at (nearly) equal parameter count.

    A ``vanilla`` config stands for itself; its fine-grained form splits each expert into
    ``granularity`` (E*g experts of width F/g, top k*g: DeepSeekMoE's segmentation). Any other
    config is the fine-grained shape, and vanilla is E/g experts of width F*g, top k/g. BigMac
    takes the fine-grained shape with ``downscale_factor`` (the config's, else 0.25).
    Capacity factors are each structure's default ("auto").
    """
    o = "model-info"
    if not isinstance(granularity, int) or granularity < 1:
        raise config_error(o, "granularity", granularity, "must be a positive integer")
    moe = cfg.moe
    E, F, k = moe.num_experts, moe.d_expert, moe.top_k
    g = granularity
    if moe.structure == "vanilla":
        if F % g:
            raise config_error(o, "granularity", g, f"must divide d_expert={F} to split each "
                               "vanilla expert into equal fine-grained ones")
        fine = dict(num_experts=E * g, d_expert=F // g, top_k=k * g)
        vanilla = dict(num_experts=E, d_expert=F, top_k=k)
    else:
        if E % g or k % g:
            raise config_error(o, "granularity", g, f"must divide num_experts={E} and "
                               f"top_k={k} to merge fine-grained experts into vanilla ones")
        fine = dict(num_experts=E, d_expert=F, top_k=k)
        vanilla = dict(num_experts=E // g, d_expert=F * g, top_k=k // g)
    r = downscale_factor if downscale_factor is not None else (
        moe.downscale_factor if moe.structure == "bigmac" else None)
    base = dict(capacity_factor="auto", downscale_factor=None)
    try:
        return [cfg.replace(moe={**base, **vanilla, "structure": "vanilla"}),
                cfg.replace(moe={**base, **fine, "structure": "fine_grained"}),
                cfg.replace(moe={**base, **fine, "structure": "bigmac", "downscale_factor": r})]
    except ConfigError as err:
        raise ConfigError(f"model-info: a structure variant of this config is invalid: {err}")


def format_costs(costs: list[ModelCost], tokens: int | None = None) -> str:
    """A table of ``costs``, with ratios to the fine-grained row (when there is one)."""
    ref = next((c for c in costs if c.structure == "fine_grained"), costs[0])

    def rel(v: float, base: float) -> str:
        return f"{100 * (v / base - 1):+.2f}%" if base else "n/a"
    head = (f"{'structure':<13} {'E':>4} {'k':>2} {'F':>5} {'hidden':>6} {'a2a w':>5} "
            f"{'cap':>5} {'params':>12} {'vs fine':>8} {'train FLOP/tok':>15} {'vs fine':>8} "
            f"{'A2A B/tok':>11} {'vs fine':>8} {'off-rank B/tok':>14}")
    lines = [head, "-" * len(head)]
    for c in costs:
        cap = "none" if c.capacity_factor is None else f"{c.capacity_factor:g}"
        lines.append(
            f"{c.structure:<13} {c.num_experts:>4} {c.top_k:>2} {c.d_expert:>5} "
            f"{c.expert_hidden:>6} {c.comm_width:>5} {cap:>5} {c.params_total:>12,} "
            f"{rel(c.params_total, ref.params_total):>8} {c.train_flops_per_token:>15,.0f} "
            f"{rel(c.train_flops_per_token, ref.train_flops_per_token):>8} "
            f"{c.a2a_bytes_per_token:>11,.0f} "
            f"{rel(c.a2a_bytes_per_token, ref.a2a_bytes_per_token):>8} "
            f"{c.a2a_offrank_bytes_per_token:>14,.0f}")
    c0 = costs[0]
    lines.append(f"A2A bytes: dispatch + combine, forward + backward, all MoE layers, "
                 f"{c0.bytes_per_element} B/element; off-rank: the (p-1)/p leaving a rank "
                 f"under uniform routing, p = {c0.ep_size}")
    if tokens:
        lines.append(f"per batch of {tokens:,} tokens: " + "; ".join(
            f"{c.structure}: {c.train_flops_per_token * tokens / 1e12:,.2f} TFLOP, A2A "
            f"{c.a2a_bytes_per_token * tokens / 2**30:,.1f} GiB "
            f"({c.a2a_offrank_bytes_per_token * tokens / 2**30:,.1f} GiB off-rank)"
            for c in costs))
    return "\n".join(lines)


def _gated(activation: str) -> bool:
    """Whether the experts hold a third (up) projection for this activation."""
    from moeflow.experts.activations import ACTIVATIONS

    return activation in ACTIVATIONS and ACTIVATIONS[activation].gated
