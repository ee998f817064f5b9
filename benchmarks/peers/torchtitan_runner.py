"""torchtitan's MoE layer (``torchtitan.models.common.moe.MoE``) as a peer of
``moeflow bench layer --compare torchtitan``: run with the interpreter of the virtual
environment that ``docs/benchmarks/install_torchtitan.sh`` builds, as
``PYTHON benchmarks/peers/torchtitan_runner.py CASE_FILE`` (protocol: ``protocol.py`` here).

The layer is GShard's top-k MoE (Lepikhin et al., Section 2.2) with dropless SwiGLU experts:
torchtitan's ``TokenChoiceTopKRouter`` (softmax scores, ``route_norm`` = moeflow's
renormalized top-k, no expert-bias load balancing), its ``GroupedExperts`` and its token
dispatcher: ``LocalTokenDispatcher`` on one rank, ``AllToAllTokenDispatcher`` expert parallel
over the peer's own gloo ranks. Outside torchtitan's trainer, expert parallelism needs:

* the ``partial_dtensor`` SPMD backend (``set_spmd_backend``): the default ``spmd_types``
  backend takes its process group from a current SPMD mesh that only the trainer sets;
* the dispatcher wired to a 1-D ``"ep"`` device mesh (``wire_meshes``), and the experts
  module built with this rank's ``E / world`` experts only (no ``parallelize``: the weights
  stay plain tensors, the router replicated).

Weights copied from moeflow's layout: ``gate.weight = router.T`` ``(E, M)``;
``w1_EFD = w1.transpose(1, 2)``, ``w3_EFD = w3.transpose(1, 2)`` ``(e, H, M)``;
``w2_EDF = w2.transpose(1, 2)`` ``(e, M, H)``.

Precision: torchtitan's experts cast their operands to bfloat16 unless told otherwise. For
"fp64" and "fp32" this runner tells them otherwise with one shim, ``InputDtypeExperts``: the
same three GEMMs in the input's dtype (``torch._grouped_mm`` as torchtitan's own seam in
float32; one matmul per expert in float64, where torch has no grouped GEMM). "bf16" runs
torchtitan's experts as shipped. Its combine multiplies the expert outputs by the scores in
float32 by design, so its float64 parity holds to float32 round-off (the tolerance below).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import protocol

# torchtitan's combine rounds expert outputs through float32 (see the module docstring)
RTOL, ATOL = 1e-5, 1e-7


def _experts_in_input_dtype(cls):
    class InputDtypeExperts(cls):
        """torchtitan's GroupedExperts computing in its input's dtype (not bfloat16)."""

        def forward(self, x_RD, num_tokens_per_expert_E):
            offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)

            def mm(a, w):                       # a @ w.T per expert, w: (e, out, in)
                if a.dtype == torch.float64:
                    counts = num_tokens_per_expert_E.tolist()
                    return torch.cat([ai @ wi.t() for ai, wi in
                                      zip(torch.split(a, counts), w.unbind(0))])
                return self._grouped_mm(A=a, B_t=w.transpose(-2, -1), offs=offsets)

            h = F.silu(mm(x_RD, self.w1_EFD)) * mm(x_RD, self.w3_EFD)
            return mm(h, self.w2_EDF)
    return InputDtypeExperts


def build(case: dict, dtype: str) -> torch.nn.Module:
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (MoE, GroupedExperts, RoutedExperts,
                                              TokenChoiceTopKRouter)
    from torchtitan.models.common.token_dispatcher import (AllToAllTokenDispatcher,
                                                           LocalTokenDispatcher)

    cfg = case["config"]
    m, h, e, k = cfg["d_model"], cfg["d_expert"], cfg["num_experts"], cfg["top_k"]
    world = cfg["world"]
    set_spmd_backend("partial_dtensor")
    dispatcher = (LocalTokenDispatcher.Config(num_experts=e, top_k=k) if world == 1
                  else AllToAllTokenDispatcher.Config(num_experts=e, top_k=k))
    moe = MoE.Config(
        num_experts=e,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=m, hidden_dim=h,
                                                num_experts=cfg["num_local"]),
            token_dispatcher=dispatcher),
        router=TokenChoiceTopKRouter.Config(
            num_experts=e, gate=Linear.Config(in_features=m, out_features=e), top_k=k,
            score_func="softmax", route_norm=bool(cfg["renormalize"])),
        load_balance_coeff=None).build()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    inner = moe.routed_experts.inner_experts
    if dtype != "bf16":
        inner.__class__ = _experts_in_input_dtype(type(inner))
    param_dtype = torch.float64 if dtype == "fp64" else torch.float32
    moe = moe.to(param_dtype)
    with torch.no_grad():
        moe.router.gate.weight.copy_(case["router"].t())
        inner.w1_EFD.copy_(case["w1"].transpose(1, 2))
        inner.w3_EFD.copy_(case["w3"].transpose(1, 2))
        inner.w2_EDF.copy_(case["w2"].transpose(1, 2))
    moe.train()
    return moe


if __name__ == "__main__":
    sys.exit(protocol.run(build, sys.argv[1:], RTOL, ATOL))
