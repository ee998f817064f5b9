"""moeflow: Mixture-of-Experts training across many devices.

Public API (see docs/design.md): ``MoEConfig``, ``Topology``, ``MoELayer``, ``sync_gradients``,
and the registries through which routers, codecs and all-to-all algorithms plug in.
"""

from moeflow.comm.alltoall import AllToAll, Pending, register_alltoall
from moeflow.comm.codecs import Codec, register_codec
from moeflow.experts.activations import Activation, register_activation
from moeflow.experts.ffn import ExpertFFN, register_experts
from moeflow.config import ConfigError, GPTConfig, ModelConfig, MoEConfig, TrainConfig, model_preset
from moeflow.layer import MoELayer
from moeflow.parallel.grad_sync import sync_gradients
from moeflow.parallel.replicas import ReplicaMismatchError, check_replicas, prepare_model
from moeflow.routing import Router, Routing, register_router, update_router_biases
from moeflow.topology import Topology

__version__ = "0.1.0"

__all__ = ["Activation", "ExpertFFN", "register_activation", "register_experts",
           "AllToAll", "Codec", "ConfigError", "GPTConfig", "ModelConfig", "MoEConfig", "MoELayer",
           "Pending", "ReplicaMismatchError", "Router", "Routing", "Topology", "TrainConfig",
           "check_replicas", "model_preset", "prepare_model", "register_alltoall",
           "register_codec", "register_router", "sync_gradients", "update_router_biases"]
