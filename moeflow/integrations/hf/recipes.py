"""``MoEConfig`` recipes from transformers configs (``moe_config_from_hf(config)``).

What the recipe sets, per model type (see :mod:`.architectures` for the blocks):

* ``capacity_factor=None``: every transformers MoE block is dropless.
* ``activation``: ``swiglu`` (``hidden_act='silu'``; others are refused), GPT-OSS's
  ``clamped_swiglu`` with its ``swiglu_alpha`` / ``swiglu_limit``, expert biases, router bias.
* ``renormalize``: Mixtral and GPT-OSS renormalise the top-k weights, the others follow
  ``norm_topk_prob``.
* the router: DeepSeek-V3's ``n_group`` / ``topk_group`` / ``routed_scaling_factor``, with
  the auxiliary-loss-free bias update at the paper's speed (0.001) and no balancing loss
  (transformers computes none for DeepSeek-V3).
* shared experts: Qwen2-MoE's gated one (``shared_expert_intermediate_size``), DeepSeek-V3's
  ``n_shared_experts`` of ``moe_intermediate_size``.
* the balancing-loss scale. transformers' ``load_balancing_loss_func`` returns
  ``E sum_e (sum_j f_{j,e}) P_e`` with ``f_{j,e}`` the fraction of tokens whose j-th choice is
  e: ``top_k`` times moeflow's ``all_choices`` loss (whose ``f_e`` is divided by ``T k``). It
  pools the tokens of all MoE layers into one loss (one ``f`` and one ``P`` over every
  layer's tokens), and the model adds ``router_aux_loss_coef`` times it, only when
  ``output_router_logits=True``. moeflow computes the loss per layer (per local batch, as
  GShard); the recipe sets ``aux_loss_coef = router_aux_loss_coef * top_k / L`` over the L
  MoE layers, so the sum of the layers' ``aux_loss`` equals transformers' value whenever the
  layers' loads are alike, and is its per-layer form otherwise (not bit-equal: pooling
  multiplies averages taken over all layers).
"""

from __future__ import annotations

from moeflow.errors import ConfigError
from moeflow.integrations.hf.architectures import BY_MODEL_TYPE


def num_moe_layers(config) -> int:
    """How many decoder layers of a transformers model of this config are sparse-MoE."""
    t, n = config.model_type, config.num_hidden_layers
    if t in ("qwen2_moe", "qwen3_moe"):
        skip, step = getattr(config, "mlp_only_layers", []), getattr(config,
                                                                    "decoder_sparse_step", 1)
        return sum(1 for i in range(n) if i not in skip and config.num_experts > 0
                   and (i + 1) % step == 0)
    if t == "deepseek_v3":
        return n - config.first_k_dense_replace
    return n


def moe_config_from_hf(config, layer_id: int = 0, **overrides):
    """The ``MoEConfig`` of one MoE layer of a transformers model; ``overrides`` set further
    fields (codec, a2a, schedule, pipeline_degree, ...)."""
    from moeflow.config import MoEConfig

    t = getattr(config, "model_type", None)
    if t not in BY_MODEL_TYPE:
        raise ConfigError(f"moe_config_from_hf: model_type={t!r} is not supported; supported: "
                          f"{', '.join(sorted(BY_MODEL_TYPE))}")
    arch = BY_MODEL_TYPE[t]
    k = config.num_experts_per_tok
    kw = dict(d_model=config.hidden_size, d_expert=getattr(config, arch.hidden_key),
              num_experts=getattr(config, arch.experts_key), top_k=k, capacity_factor=None,
              layer_id=layer_id)
    coef = getattr(config, "router_aux_loss_coef", 0.0) * k / max(1, num_moe_layers(config))
    if t == "gpt_oss":
        kw.update(activation="clamped_swiglu", expert_bias=True, renormalize=True,
                  activation_options=dict(alpha=float(getattr(config, "swiglu_alpha", 1.702)),
                                          limit=float(config.swiglu_limit)),
                  router_options=dict(bias=True), aux_loss_coef=coef)
    else:
        if config.hidden_act != "silu":
            raise ConfigError(f"moe_config_from_hf: hidden_act={config.hidden_act!r} is not "
                              "supported; moeflow converts SwiGLU experts (hidden_act='silu')")
        kw.update(activation="swiglu",
                  renormalize=True if t == "mixtral" else bool(config.norm_topk_prob),
                  aux_loss_coef=coef)
    if t == "mixtral" and getattr(config, "router_jitter_noise", 0):
        raise ConfigError(f"moe_config_from_hf: router_jitter_noise={config.router_jitter_noise}"
                          " (input jitter) has no moeflow equivalent; set it to 0")
    if t == "qwen2_moe":
        kw.update(num_shared_experts=1, shared_expert_gate=True,
                  shared_expert_hidden=config.shared_expert_intermediate_size)
    if t == "deepseek_v3":
        kw.update(router="deepseek_v3", aux_loss_coef=0.0,
                  router_options=dict(n_group=config.n_group, topk_group=config.topk_group,
                                      routed_scaling_factor=float(config.routed_scaling_factor),
                                      bias_update_speed=0.001))
        if config.n_shared_experts:
            kw.update(num_shared_experts=config.n_shared_experts,
                      shared_expert_hidden=config.moe_intermediate_size)
    return MoEConfig(**{**kw, **overrides})
