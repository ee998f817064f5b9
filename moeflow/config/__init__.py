"""Configuration dataclasses with validation, one module per config:

* :mod:`moeflow.config.moe`: ``MoEConfig``, one MoE layer, and its checks;
* :mod:`moeflow.config.model`: ``ModelConfig`` / ``GPTConfig``, the GPT, its MoE blocks one
  nested ``MoEConfig``;
* :mod:`moeflow.config.training`: ``TrainConfig``, ``moeflow train``'s optimisation and layout;
* :mod:`moeflow.config.presets`: the named model sizes;
* :mod:`moeflow.config.validation`: the ``ConfigError`` helpers they share.

Every bad value fails at construction with a :class:`ConfigError` naming the field, the value
and the fix. The public names are re-exported here (``from moeflow.config import MoEConfig``).
"""

from moeflow.config.validation import config_error
from moeflow.config.model import (MODEL_MOE_DEFAULTS, MODEL_OWNED_MOE_FIELDS, GPTConfig,
                                  ModelConfig, check_model_field_names, check_moe_field_names,
                                  config_differences)
from moeflow.config.moe import (ACTIVATIONS, AUTO, AUTO_LOSSY, AUTO_PLACEMENTS,
                                BALANCE_LOSSES, CAPACITY_PADDINGS, DEFAULT_AUTOTUNE_BUDGET_S,
                                DEFAULT_CAPACITY_FACTOR, DEFAULT_DOWNSCALE_FACTOR,
                                DEFAULT_LOSSY_ERROR_BUDGET, FROM_CONFIG, MOE_RECOMPUTES,
                                PARM_SCHEDULES, STRUCTURES, MoEConfig)
from moeflow.config.presets import PRESETS, model_preset
from moeflow.config.training import DENSE_SHARDS, TRAIN_RECOMPUTES, TrainConfig
from moeflow.devices import DEVICES, DTYPES
from moeflow.errors import ConfigError

__all__ = ["ACTIVATIONS", "AUTO", "AUTO_LOSSY", "AUTO_PLACEMENTS", "BALANCE_LOSSES",
           "CAPACITY_PADDINGS",
           "DEFAULT_AUTOTUNE_BUDGET_S", "DEFAULT_CAPACITY_FACTOR", "DEFAULT_DOWNSCALE_FACTOR",
           "DEFAULT_LOSSY_ERROR_BUDGET", "DENSE_SHARDS", "DEVICES", "DTYPES", "FROM_CONFIG",
           "MODEL_MOE_DEFAULTS", "MODEL_OWNED_MOE_FIELDS", "MOE_RECOMPUTES", "PARM_SCHEDULES",
           "PRESETS", "STRUCTURES", "TRAIN_RECOMPUTES", "ConfigError", "GPTConfig",
           "ModelConfig", "MoEConfig", "TrainConfig", "check_model_field_names",
           "check_moe_field_names", "config_differences", "config_error", "model_preset"]
