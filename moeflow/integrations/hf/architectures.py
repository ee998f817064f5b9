"""The six transformers sparse-MoE blocks moeflow converts, and their weight layouts.

Every block computes ``y = sum_j g_j E_{e_j}(x) [+ shared(x)]`` with SwiGLU experts; they
differ in routing and layout (transformers 5.x, experts stored as 3-D tensors):

* ``MixtralSparseMoeBlock`` (mixtral): softmax, top-k renormalised; experts
  ``gate_up_proj (E, 2H, M)`` = [gate; up] and ``down_proj (E, M, H)``.
* ``Qwen2MoeSparseMoeBlock`` (qwen2_moe): softmax, ``norm_topk_prob``; experts as Mixtral;
  a ``shared_expert`` MLP scaled by ``sigmoid(shared_expert_gate(x))``.
* ``Qwen3MoeSparseMoeBlock`` (qwen3_moe), ``OlmoeSparseMoeBlock`` (olmoe): softmax,
  ``norm_topk_prob``; experts as Mixtral.
* ``DeepseekV3MoE`` (deepseek_v3): sigmoid scores, ``e_score_correction_bias``, groups,
  ``routed_scaling_factor``; experts as Mixtral; ``shared_experts`` MLP (the
  ``n_shared_experts`` side by side).
* ``GptOssMLP`` (gpt_oss): logits ``x W^T + b``, softmax over the top-k logits; experts
  ``gate_up_proj (E, M, 2H)`` with gate / up interleaved (``::2`` / ``1::2``), its bias,
  ``down_proj (E, H, M)`` and its bias; clamped SwiGLU.

moeflow's layout: ``router.weight (M, E)`` (``x @ W``), experts ``w1``/``w3 (E, M, H)``,
``w2 (E, H, M)``, biases ``b1``/``b3 (E, H)``, ``b2 (E, M)``; shared ``w1``/``w3 (M, Hs)``,
``w2 (Hs, M)``, ``gate (M,)``. The maps below are transposes and slices: exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.errors import ConfigError


@dataclass(frozen=True)
class Architecture:
    model_type: str
    block: str                    # class name of the transformers block
    router: str                   # the block's router attribute
    experts_key: str              # config field holding the number of routed experts
    hidden_key: str               # config field holding the experts' hidden width
    shared: str | None = None     # the shared experts' MLP attribute
    shared_gate: str | None = None
    gpt_oss: bool = False         # interleaved gate/up, (E, M, 2H) layout, biases
    returns_router_scores: bool = False   # forward returns (y, router_scores)


ARCHITECTURES = {a.block: a for a in [
    Architecture("mixtral", "MixtralSparseMoeBlock", "gate", "num_local_experts",
                 "intermediate_size"),
    Architecture("qwen2_moe", "Qwen2MoeSparseMoeBlock", "gate", "num_experts",
                 "moe_intermediate_size", shared="shared_expert",
                 shared_gate="shared_expert_gate"),
    Architecture("qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate", "num_experts",
                 "moe_intermediate_size"),
    Architecture("olmoe", "OlmoeSparseMoeBlock", "gate", "num_experts", "intermediate_size"),
    Architecture("deepseek_v3", "DeepseekV3MoE", "gate", "n_routed_experts",
                 "moe_intermediate_size", shared="shared_experts"),
    Architecture("gpt_oss", "GptOssMLP", "router", "num_local_experts", "intermediate_size",
                 gpt_oss=True, returns_router_scores=True),
]}
BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}


def architecture_of(block) -> Architecture | None:
    """The architecture of a transformers module, or None if it is not a known MoE block."""
    return ARCHITECTURES.get(type(block).__name__)


def _require_silu(act_fn, where: str) -> None:
    name = type(act_fn).__name__
    if name not in ("SiLUActivation", "SiLU"):
        raise ConfigError(f"{where} uses the activation {name}; moeflow converts SwiGLU experts "
                          "(hidden_act='silu') only: set hidden_act='silu'")


def block_config(block, arch: Architecture) -> dict:
    """The MoEConfig fields that make a moeflow layer compute what ``block`` computes (read
    from its modules; the balancing-loss scale comes from the model config, see recipes)."""
    router, experts = getattr(block, arch.router), block.experts
    E, M = router.weight.shape
    where = type(block).__name__
    kw = dict(d_model=M, num_experts=E, top_k=router.top_k, capacity_factor=None)
    if arch.gpt_oss:
        kw.update(d_expert=experts.down_proj.shape[1], activation="clamped_swiglu",
                  activation_options=dict(alpha=float(experts.alpha),
                                          limit=float(experts.limit)),
                  expert_bias=True, renormalize=True, router_options=dict(bias=True))
        return kw
    _require_silu(experts.act_fn, f"{where}.experts")
    kw.update(d_expert=experts.down_proj.shape[2], activation="swiglu")
    if getattr(block, "jitter_noise", 0):
        raise ConfigError(f"{where}.jitter_noise={block.jitter_noise} (router_jitter_noise) "
                          "multiplies the input by noise in training; moeflow has no such "
                          "noise: set router_jitter_noise=0 (gate_noise adds logit noise)")
    if arch.model_type == "mixtral":
        kw["renormalize"] = True
    else:
        kw["renormalize"] = bool(router.norm_topk_prob)
    if arch.model_type == "deepseek_v3":
        kw.update(router="deepseek_v3", router_options=dict(
            n_group=router.num_group, topk_group=router.topk_group,
            routed_scaling_factor=float(router.routed_scaling_factor)))
    if arch.shared is not None:
        mlp = getattr(block, arch.shared)
        _require_silu(mlp.act_fn, f"{where}.{arch.shared}")
        kw.update(num_shared_experts=1, shared_expert_hidden=mlp.gate_proj.out_features,
                  shared_expert_gate=arch.shared_gate is not None)
    return kw


def moeflow_from_hf(arch: Architecture, sd: dict, first: int, n: int) -> dict:
    """A moeflow layer's state dict (its local experts ``first .. first+n-1``) from a
    transformers block's state dict (keys relative to the block)."""
    r = arch.router
    out = {"router.weight": sd[f"{r}.weight"].t()}
    if arch.gpt_oss:
        out["router.bias"] = sd[f"{r}.bias"]
        gu, gub = sd["experts.gate_up_proj"][first:first + n], \
            sd["experts.gate_up_proj_bias"][first:first + n]
        out.update({"experts.w1": gu[..., ::2], "experts.w3": gu[..., 1::2],
                    "experts.b1": gub[..., ::2], "experts.b3": gub[..., 1::2],
                    "experts.w2": sd["experts.down_proj"][first:first + n],
                    "experts.b2": sd["experts.down_proj_bias"][first:first + n]})
    else:
        gu = sd["experts.gate_up_proj"][first:first + n]
        H = gu.shape[1] // 2
        out.update({"experts.w1": gu[:, :H].transpose(1, 2), "experts.w3":
                    gu[:, H:].transpose(1, 2),
                    "experts.w2": sd["experts.down_proj"][first:first + n].transpose(1, 2)})
    if arch.model_type == "deepseek_v3":
        out["router.e_score_correction_bias"] = sd[f"{r}.e_score_correction_bias"]
    if arch.shared is not None:
        s = arch.shared
        out.update({"shared.w1": sd[f"{s}.gate_proj.weight"].t(),
                    "shared.w3": sd[f"{s}.up_proj.weight"].t(),
                    "shared.w2": sd[f"{s}.down_proj.weight"].t()})
        if arch.shared_gate is not None:
            out["shared.gate"] = sd[f"{arch.shared_gate}.weight"][0]
    return {k: v.contiguous() for k, v in out.items()}


def hf_from_moeflow(arch: Architecture, sd: dict) -> dict:
    """A transformers block's state dict from a moeflow layer's with *all* experts."""
    r = arch.router
    out = {f"{r}.weight": sd["router.weight"].t()}
    if arch.gpt_oss:
        out[f"{r}.bias"] = sd["router.bias"]
        w1, w3, b1, b3 = (sd[f"experts.{k}"] for k in ("w1", "w3", "b1", "b3"))
        out["experts.gate_up_proj"] = torch.stack([w1, w3], -1).flatten(-2)    # interleave
        out["experts.gate_up_proj_bias"] = torch.stack([b1, b3], -1).flatten(-2)
        out["experts.down_proj"] = sd["experts.w2"]
        out["experts.down_proj_bias"] = sd["experts.b2"]
    else:
        out["experts.gate_up_proj"] = torch.cat([sd["experts.w1"], sd["experts.w3"]],
                                                2).transpose(1, 2)
        out["experts.down_proj"] = sd["experts.w2"].transpose(1, 2)
    if arch.model_type == "deepseek_v3":
        out[f"{r}.e_score_correction_bias"] = sd["router.e_score_correction_bias"]
    if arch.shared is not None:
        s = arch.shared
        out.update({f"{s}.gate_proj.weight": sd["shared.w1"].t(),
                    f"{s}.up_proj.weight": sd["shared.w3"].t(),
                    f"{s}.down_proj.weight": sd["shared.w2"].t()})
        if arch.shared_gate is not None:
            out[f"{arch.shared_gate}.weight"] = sd["shared.gate"].unsqueeze(0)
    return {k: v.contiguous() for k, v in out.items()}
