"""Hugging Face ``transformers`` interop (``pip install 'moeflow[hf]'``); docs/hf.md.

* :func:`from_hf` / :func:`to_hf`: one sparse-MoE block <-> an equivalent :class:`MoELayer`,
  weights mapped exactly (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS).
* :func:`replace_moe_blocks`: swap every MoE block of a transformers model; returns the
  collector of the layers' auxiliary losses.
* :func:`hf_state_dict` / :func:`load_hf_state_dict`: the swapped model's state dict in the
  original class's key names and layouts (experts gathered by global expert id over the
  expert-parallel ranks), so ``save_pretrained`` / ``from_pretrained`` of the original class
  read and write moeflow-trained weights.
* :func:`moe_config_from_hf`: the MoEConfig recipe from a transformers config (here, not on
  ``MoEConfig``: the config module stays below the integrations).
"""

from moeflow.integrations.hf.architectures import ARCHITECTURES, architecture_of
from moeflow.integrations.hf.convert import (AuxLosses, HFMoEBlock, from_hf, hf_state_dict,
                                             load_hf_state_dict, replace_moe_blocks,
                                             save_pretrained, to_hf)
from moeflow.integrations.hf.recipes import moe_config_from_hf

__all__ = ["ARCHITECTURES", "AuxLosses", "HFMoEBlock", "architecture_of", "from_hf",
           "hf_state_dict", "load_hf_state_dict", "moe_config_from_hf", "replace_moe_blocks",
           "save_pretrained", "to_hf"]
