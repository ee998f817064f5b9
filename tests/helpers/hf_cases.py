"""Tiny transformers configs of the six MoE architectures and the float64 router patch
(importable by spawned ranks; used by tests/unit/integrations/test_hf.py). Needs transformers."""

from __future__ import annotations

import contextlib

import torch
import transformers as tf

COMMON = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
              num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)

CONFIGS = {
    "mixtral": lambda: tf.MixtralConfig(**COMMON, intermediate_size=12, num_local_experts=4),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**COMMON, intermediate_size=24,
                                           moe_intermediate_size=12, num_experts=4,
                                           shared_expert_intermediate_size=20),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**COMMON, intermediate_size=24,
                                           moe_intermediate_size=12, num_experts=4,
                                           norm_topk_prob=True),
    "olmoe": lambda: tf.OlmoeConfig(**COMMON, intermediate_size=12, num_experts=4),
    "deepseek_v3": lambda: tf.DeepseekV3Config(
        **COMMON, intermediate_size=24, moe_intermediate_size=12, n_routed_experts=8,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, rope_parameters=dict(rope_type="default",
                                                                rope_theta=10000.0)),
    "gpt_oss": lambda: tf.GptOssConfig(**COMMON, intermediate_size=12, num_local_experts=4,
                                       head_dim=8, swiglu_limit=0.5),
}


def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A float64 model of the tiny config with random (non-zero) router weights and biases,
    experts run by transformers' eager loop (its grouped_mm path refuses float64)."""
    config = CONFIGS[name]()
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).double().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mname, t in list(model.named_parameters()) + list(model.named_buffers()):
            if ".mlp." in mname and t.is_floating_point():
                scale = 0.3 if "correction_bias" not in mname else 0.05
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * scale)
    return model


@contextlib.contextmanager
def float64_routers():
    """transformers' routers cast to float32 (Mixtral ``logits.float()``, Qwen/OLMoE
    ``softmax(..., dtype=torch.float)``, DeepSeek-V3 ``x.type(torch.float32)``), which limits
    a float64 comparison to ~1e-7. Within this block those three casts leave float64 tensors
    in float64 (``Tensor.float``, ``Tensor.type`` and ``F.softmax``'s ``dtype`` are wrapped),
    so the block's router runs in float64 like moeflow's does for float64 input."""
    F = torch.nn.functional
    float_, type_, softmax = torch.Tensor.float, torch.Tensor.type, F.softmax

    def keep_float(self, *a, **k):
        return self if self.dtype == torch.float64 else float_(self, *a, **k)

    def keep_type(self, dtype=None, *a, **k):
        if dtype in (torch.float32, torch.float) and self.dtype == torch.float64:
            return self
        return type_(self, dtype, *a, **k)

    def keep_softmax(x, *a, dtype=None, **k):
        if x.dtype == torch.float64:
            dtype = None
        return softmax(x, *a, dtype=dtype, **k)

    torch.Tensor.float, torch.Tensor.type, F.softmax = keep_float, keep_type, keep_softmax
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.type, F.softmax = float_, type_, softmax


def tokens(seed: int, batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def ep_worker(name: str, save_dir: str) -> dict:
    """On each of 2 ranks: swap the MoE blocks of the same model with the experts split over
    the ranks (expert parallelism), check the logits on this rank's batch, then save through
    the conversion (collective; rank 0 writes)."""
    from moeflow import Topology
    from moeflow.integrations.hf import replace_moe_blocks, save_pretrained

    topo = Topology.from_env()
    model = make_model(name)
    ids = tokens(10 + topo.rank)
    with torch.no_grad(), float64_routers():
        want = model(ids).logits
        aux = replace_moe_blocks(model, topo)
        got = model(ids).logits
        # perturb this rank's experts so that the saved weights are not the loaded ones
        for layer in aux.layers:
            layer.experts.w2.add_(0.01 * (topo.rank + 1))
        after = model(tokens(20)).logits     # collective: every rank runs it
    save_pretrained(model, save_dir, topo)
    return {"want": want, "got": got, "after": after,
            "num_local": aux.layers[0].num_local}
