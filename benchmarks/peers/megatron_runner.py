"""Megatron-core 0.19.2's MoE layer (``megatron.core.transformer.moe.moe_layer.MoELayer``,
alltoall token dispatcher, ``SequentialMLP`` experts: its local, non-Transformer-Engine spec)
as a peer of ``moeflow bench layer --compare megatron``: run with the interpreter of the
virtual environment that ``docs/benchmarks/install_megatron_core.sh`` builds, as
``PYTHON benchmarks/peers/megatron_runner.py CASE_FILE`` (protocol: ``protocol.py`` here).

The layer is GShard's top-k MoE (Lepikhin et al., Section 2.2), dropless, SwiGLU experts
(``gated_linear_unit`` with silu): Megatron's ``TopKRouter`` (softmax over the top-k logits,
which equals moeflow's renormalized top-k of the full softmax; no aux loss, no z-loss),
``MoEAlltoAllTokenDispatcher`` expert parallel over the peer's own gloo ranks
(``parallel_state.initialize_model_parallel(expert_model_parallel_size=world)``).

Megatron-core is written for CUDA; small shims, applied here and nowhere else, let its
layer run on CPU without changing what it computes:

* the alltoall dispatcher creates a CUDA stream at construction (``cuda_dtoh_stream``) and
  its device-to-host copies of the token counts use it: ``torch.cuda.Stream`` /
  ``torch.cuda.stream`` / ``torch.cuda.current_stream`` become no-op stand-ins, so the copies
  run on the CPU's one stream;
* the router moves its weight to the current CUDA device at construction and in forward
  (``torch.cuda.current_device``): the router's device is the CPU (``_maintain_float32``-style
  moves go to "cpu");
* ``torch.cuda.synchronize`` (called around the counts' copy) is a no-op on CPU; the copy
  itself (``moe_utils.maybe_move_tensor_to_cpu``) only converts CUDA tensors, and the
  all-to-all wants the split sizes as it gets them on CUDA (numpy arrays, not tensors): the
  shim converts the CPU tensors the same way.

Weights copied from moeflow's layout: router ``weight = router.T`` ``(E, M)``; local expert i's
``linear_fc1.weight = cat(w1[i].T, w3[i].T)`` ``(2H, M)`` (gate rows first, as Megatron's
``glu`` splits them) and ``linear_fc2.weight = w2[i].T`` ``(M, H)``.

Precision: the router's softmax runs in float32 whatever the layer's dtype (by design), so the
float64 parity holds to float32 round-off (the tolerance below). "bf16" builds the layer with
bfloat16 parameters (``bf16=True``, router in float32).
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

import protocol

# Megatron computes the router's softmax in float32 by design (moe_utils.topk_routing_with_score
# _function: softmax(..., dtype=torch.float32)), so float64 parity holds to float32 round-off
RTOL, ATOL = 1e-5, 1e-6


class _NoStream:
    """A stand-in CUDA stream on CPU (the CPU has one stream; waits are no-ops)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return self                      # an "event" whose synchronize() returns at once


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the CPU: the same result
    as its CUDA branch (a numpy array where asked, which the all-to-all's split sizes need)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().numpy()
    return tensor


def cpu_shims() -> None:
    """The shims of the module docstring (this process only)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    torch.cuda.Stream = _NoStream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"
    moe_utils.maybe_move_tensor_to_cpu = _to_host
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host


def build(case: dict, dtype: str) -> torch.nn.Module:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = case["config"]
    m, h, e, k, world = (cfg["d_model"], cfg["d_expert"], cfg["num_experts"], cfg["top_k"],
                         cfg["world"])
    if not parallel_state.model_parallel_is_initialized():
        if world == 1:
            torch.distributed.init_process_group(
                "gloo", init_method=f"tcp://{cfg['addr']}:{cfg['port']}", rank=0,
                world_size=1)
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    param_dtype = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    tc = TransformerConfig(
        num_layers=1, hidden_size=m, num_attention_heads=1, ffn_hidden_size=h,
        moe_ffn_hidden_size=h, num_moe_experts=e, moe_router_topk=k,
        moe_router_score_function="softmax", moe_router_pre_softmax=not cfg["renormalize"],
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", moe_grouped_gemm=False,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        expert_model_parallel_size=world, use_cpu_initialization=True,
        perform_initialization=False, params_dtype=param_dtype,
        bf16=dtype == "bf16", moe_router_dtype="fp32" if dtype != "fp64" else None)
    layer = get_moe_module_spec(use_te=False, num_experts=e, moe_grouped_gemm=False)(
        config=tc).to(param_dtype)
    with torch.no_grad():
        layer.router.weight.copy_(case["router"].t())
        for i, mlp in enumerate(layer.experts.local_experts):
            mlp.linear_fc1.weight.copy_(torch.cat([case["w1"][i].t(), case["w3"][i].t()]))
            mlp.linear_fc2.weight.copy_(case["w2"][i].t())
    layer.train()
    return _SequenceFirst(layer, param_dtype)


class _SequenceFirst(torch.nn.Module):
    """``(T, M)`` tokens in, as Megatron's ``(S, B, M)`` with B = 1; its output (the first of
    ``(output, bias)``) back as ``(T, M)``."""

    def __init__(self, layer, dtype):
        super().__init__()
        self.layer, self.dtype = layer, dtype

    def forward(self, x):
        out = self.layer(x.to(self.dtype).unsqueeze(1))
        y = out[0] if isinstance(out, tuple) else out
        return y.squeeze(1)


if __name__ == "__main__":
    cpu_shims()
    sys.exit(protocol.run(build, sys.argv[1:], RTOL, ATOL))
