"""The named model sizes of ``moeflow train --preset`` and ``model_preset``, which lays a
preset's fields and its MoE fields under the user's overrides."""

from __future__ import annotations

from moeflow.config.validation import config_error
from moeflow.config.model import ModelConfig, check_model_field_names, check_moe_field_names
from moeflow.registry import did_you_mean

PRESETS: dict[str, dict] = {
    # Sized for a 2-core CPU: trains to < 2.0 nats/byte on the default corpus in minutes.
    "tiny": dict(seq_len=128, d_model=128, n_layers=4, n_heads=4, d_ff=512, moe_every=2,
                 moe=dict(num_experts=8, d_expert=256, top_k=2)),
    "small": dict(seq_len=256, d_model=256, n_layers=6, n_heads=8, d_ff=1024, moe_every=2,
                  moe=dict(num_experts=16, d_expert=512, top_k=2)),
    "medium": dict(seq_len=1024, d_model=1024, n_layers=24, n_heads=16, d_ff=4096,
                   moe_every=2, moe=dict(num_experts=64, d_expert=4096, top_k=2)),
}


def model_preset(name: str, **overrides) -> ModelConfig:
    """Preset ``name`` with ``overrides``: ModelConfig fields, and ``moe`` as a dict of
    MoEConfig fields laid over the preset's (or a whole MoEConfig)."""
    if name not in PRESETS:
        raise config_error("ModelConfig", "preset", name,
                           f"choose one of {', '.join(PRESETS)}{did_you_mean(name, PRESETS)}")
    check_model_field_names("ModelConfig", overrides)
    base = PRESETS[name]
    moe = overrides.get("moe")
    if moe is None or isinstance(moe, dict):
        check_moe_field_names(moe or {})
        moe = {**base["moe"], **(moe or {})}
    return ModelConfig(**{**base, **overrides, "moe": moe})
