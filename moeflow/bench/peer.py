"""Peers: other MoE layer implementations run side by side with moeflow's (a check of
moeflow's speed against an established implementation of the same GShard-style layer).

A peer builds its own layer from a :class:`~moeflow.layer.MoELayer` (same config, weights
copied, so both compute the same function) and runs a step on it. ``moeflow bench layer
--compare NAME`` times the two interleaved (``moeflow.bench.compare``), checks that outputs and
input gradients agree, and reports the ratio. Peers are optional: a peer whose package is not
importable says so (``missing``) and the comparison is skipped with that message.

* ``tutel``: Microsoft Tutel's ``tutel.moe.moe_layer`` (not on the package index; install it
  from source, see docs/benchmarks/layer.md). Its weight layout, read from Tutel's source
  (``tutel/experts/ffn.py``, ``tutel/gates/top.py``): router ``wg.weight`` is ``(E, M)``
  (moeflow's ``(M, E)`` transposed); ``batched_fc1_w`` is ``(E_local, H, M)`` (moeflow's
  ``w1: (E_local, M, H)`` transposed); ``batched_fc2_w`` is ``(E_local, H, M)`` like ``w2``.
  Its capacity is ``k * int(f * ceil(T / E))`` (``tutel/impls/fast_dispatch.py``), which
  equals moeflow's ``ceil(f * k * T / E)`` when ``f * ceil(T / E)`` is an integer (checked).
* ``moeflow-fixed``: moeflow itself with fixed direct / sequential / r = 1 exchange settings:
  a peer that is always present, so the comparison logic is tested without Tutel.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.config import ConfigError


class Peer:
    name = ""

    def missing(self) -> str | None:
        """Why this peer cannot run here (None when it can)."""
        return None

    def check(self, layer, tokens: int) -> None:
        """Raise ConfigError if the peer cannot compute ``layer``'s function exactly."""

    def build(self, layer) -> nn.Module:
        raise NotImplementedError

    def forward(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, aux_loss)`` for ``x: (T, M)``."""
        raise NotImplementedError


class TutelPeer(Peer):
    name = "tutel"

    def missing(self) -> str | None:
        if importlib.util.find_spec("tutel") is None:
            return ("tutel is not importable; it is not on the package index: install it from "
                    "its source (docs/benchmarks/layer.md, 'Installing Tutel')")
        return None

    def check(self, layer, tokens: int) -> None:
        cfg, topo = layer.cfg, layer.topo
        problems = []
        if cfg.router != "topk" or cfg.structure != "vanilla":
            problems.append("router='topk' and structure='vanilla' (Tutel's top-k gate)")
        if cfg.activation == "swiglu":
            problems.append("an elementwise activation (Tutel's ffn experts have no gate "
                            "projection)")
        if cfg.gate_noise or not cfg.renormalizes(cfg.top_k) and cfg.top_k > 1:
            problems.append("gate_noise=0 and renormalized top-k weights")
        if topo.esp_size > 1 or topo.mp_size > 1:
            problems.append("esp_size = mp_size = 1")
        if cfg.capacity_factor is None:
            problems.append("a capacity factor (Tutel's dropless mode sizes capacity by the "
                            "maximum over ranks, not as moeflow)")
        else:
            per_expert = -(-tokens // cfg.num_experts)
            tutel_cap = cfg.top_k * int(cfg.capacity_factor * per_expert)
            ours = math.ceil(round(cfg.capacity_factor * cfg.top_k * tokens / cfg.num_experts,
                                   9))
            if tutel_cap != ours:
                problems.append(f"the same capacity: Tutel's k*int(f*ceil(T/E)) = {tutel_cap}, "
                                f"moeflow's ceil(f*k*T/E) = {ours} at T={tokens}; pick T a "
                                "multiple of E with f*T/E an integer")
        if problems:
            raise ConfigError("--compare tutel needs " + "; ".join(problems))

    def build(self, layer) -> nn.Module:
        from tutel import moe as tutel_moe

        cfg, topo = layer.cfg, layer.topo
        act = getattr(F, cfg.activation)
        group = topo.ep_group if topo.distributed else None
        m = tutel_moe.moe_layer(
            gate_type={"type": "top", "k": cfg.top_k, "capacity_factor": cfg.capacity_factor,
                       "fp32_gate": True},
            model_dim=cfg.d_model,
            experts={"type": "ffn", "count_per_node": layer.num_local,
                     "hidden_size_per_expert": cfg.d_expert, "activation_fn": act,
                     "has_fc1_bias": cfg.expert_bias, "has_fc2_bias": cfg.expert_bias},
            group=group, is_gshard_loss=True)
        ex = layer.experts
        with torch.no_grad():
            m.gates[0].wg.weight.copy_(layer.router.weight.t())
            m.experts.batched_fc1_w.copy_(ex.w1.transpose(1, 2))
            m.experts.batched_fc2_w.copy_(ex.w2)
            if cfg.expert_bias:
                m.experts.batched_fc1_bias.copy_(ex.b1)
                m.experts.batched_fc2_bias.copy_(ex.b2)
        return m.to(ex.w1.device)

    def forward(self, module, x):
        y = module(x)
        return y, module.l_aux


class FixedMoeflowPeer(Peer):
    """moeflow with direct / sequential / r = 1 and the layer's weights."""

    name = "moeflow-fixed"

    def build(self, layer) -> nn.Module:
        from moeflow.layer import MoELayer

        cfg = layer.requested_cfg.replace(a2a="direct", schedule="sequential",
                                          pipeline_degree=1)
        m = MoELayer(cfg, layer.topo).to(layer.experts.w1.device)
        m.load_state_dict(layer.state_dict())
        return m

    def forward(self, module, x):
        y = module(x)
        return y, module.aux_loss


PEERS: dict[str, Peer] = {p.name: p for p in (TutelPeer(), FixedMoeflowPeer())}
