"""Float64 layout-parity cases shared by the multi-rank tests (importable by spawned ranks).

Each rank r of an N-rank job builds the layer for its topology, runs its own batch x_r, calls
backward on its local loss, syncs gradients and takes one SGD step. The reference is one
process holding every expert, running each x_r as a separate local batch (capacity and balancing
loss per local batch, as in GShard), on the mean of the local losses.
"""

from __future__ import annotations

import torch

from moeflow import MoEConfig, MoELayer, Topology, sync_gradients
from moeflow.init import seeded_normal

D_MODEL, D_EXPERT = 8, 12
TOKENS = (6, 11, 4, 9)          # tokens on rank r (different per rank on purpose)

CASES: dict[str, dict] = {
    "capacity_k2": dict(num_experts=8, top_k=2, capacity_factor=1.25),
    "capacity_k1_tight": dict(num_experts=8, top_k=1, capacity_factor=0.5),
    "dropless_k2": dict(num_experts=8, top_k=2, capacity_factor=None),
    "dropless_k_eq_E": dict(num_experts=4, top_k=4, capacity_factor=None),
    "capacity_k_eq_E": dict(num_experts=4, top_k=4, capacity_factor=1.0),
    "swiglu_dropless": dict(num_experts=8, top_k=2, capacity_factor=None, activation="swiglu"),
    "hot_expert_dropless": dict(num_experts=8, top_k=1, capacity_factor=None, hot=5),
    "hot_expert_capacity": dict(num_experts=8, top_k=2, capacity_factor=1.0, hot=2),
    "zero_token_rank": dict(num_experts=8, top_k=2, capacity_factor=1.5, tokens=(5, 0, 7, 4)),
    "z_loss_relu": dict(num_experts=4, top_k=2, capacity_factor=2.0, activation="relu",
                        z_loss_coef=0.1),
    # Tutel's options: expert biases (has_fc1_bias / has_fc2_bias), activations by name
    "expert_bias_capacity": dict(num_experts=8, top_k=2, capacity_factor=1.0, expert_bias=True),
    "expert_bias_swiglu_dropless": dict(num_experts=8, top_k=2, capacity_factor=None,
                                        activation="swiglu", expert_bias=True),
    "mish_dropless": dict(num_experts=8, top_k=2, capacity_factor=None, activation="mish"),
    "leaky_relu_bias_k1": dict(num_experts=4, top_k=1, capacity_factor=1.5,
                               activation="leaky_relu", expert_bias=True),
    # per-call overrides of top_k / capacity_factor ("call": the layer(x, **call) arguments)
    "call_top3_capacity2": dict(num_experts=8, top_k=2, capacity_factor=1.25,
                                call=dict(top_k=3, capacity_factor=2.0)),
    "call_dropless_top1": dict(num_experts=8, top_k=2, capacity_factor=1.0,
                               call=dict(top_k=1, capacity_factor=None)),
    "call_capacity_on_bigmac": dict(num_experts=8, top_k=2, structure="bigmac",
                                    downscale_factor=0.5, call=dict(capacity_factor=0.75)),
    # the GShard / DeepSpeed-MoE / Tutel balancing loss (f_e from first choices)
    "first_choice_loss_k2": dict(num_experts=8, top_k=2, capacity_factor=1.25,
                                 balance_loss="first_choice"),
    # DeepSeek-V3 routing: sigmoid scores, group-limited top-k, scaled weights
    "deepseek_v3_groups": dict(num_experts=8, top_k=2, capacity_factor=None,
                               router="deepseek_v3", aux_loss_coef=0.001,
                               router_options=dict(n_group=4, topk_group=2,
                                                   routed_scaling_factor=2.5)),
    # shared experts: Qwen2-MoE's gated one; DeepSeek-V3's two beside its router;
    # BigMac (shared experts read x, not the descended z)
    "shared_gated_capacity": dict(num_experts=8, top_k=2, capacity_factor=1.0,
                                  activation="swiglu", num_shared_experts=1,
                                  shared_expert_hidden=10, shared_expert_gate=True),
    "shared_deepseek_v3": dict(num_experts=8, top_k=2, capacity_factor=None,
                               activation="swiglu", num_shared_experts=2,
                               router="deepseek_v3", aux_loss_coef=0.0,
                               router_options=dict(n_group=2, topk_group=1,
                                                   routed_scaling_factor=2.5)),
    "shared_bias_bigmac": dict(num_experts=8, top_k=2, structure="bigmac",
                               downscale_factor=0.5, num_shared_experts=1, expert_bias=True),
    # GPT-OSS: router bias, expert biases, clamped SwiGLU (small limit: it clamps)
    "gpt_oss_pieces": dict(num_experts=8, top_k=2, capacity_factor=None,
                           activation="clamped_swiglu", expert_bias=True,
                           activation_options=dict(alpha=1.702, limit=0.5),
                           router_options=dict(bias=True)),
    # structures (BigMac): fine-grained and BigMac default to dropless routing
    "fine_grained_k4": dict(num_experts=8, top_k=4, structure="fine_grained"),
    "bigmac_k8": dict(num_experts=8, top_k=8, structure="bigmac"),       # r = 0.25: width 2
    "bigmac_swiglu_capacity": dict(num_experts=8, top_k=2, structure="bigmac",
                                   downscale_factor=0.5, capacity_factor=1.0,
                                   activation="swiglu"),
}


# SMILE bi-level routing: needs 2 nodes when distributed (run on 2 x 2 ranks).
BILEVEL_CASES: dict[str, dict] = {
    "bilevel_top1": dict(num_experts=8, top_k=1, capacity_factor=2.0, router="bilevel",
                         bilevel_nodes=2, aux_loss_coef=0.005),
    "bilevel_dropless_2x2": dict(num_experts=8, top_k=4, capacity_factor=None,
                                 router="bilevel", bilevel_nodes=2, node_top_k=2,
                                 local_top_k=2, local_loss_coef=0.02, z_loss_coef=0.01),
}


def _spec(name: str) -> dict:
    return CASES[name] if name in CASES else BILEVEL_CASES[name]


def make_config(name: str, **overrides) -> MoEConfig:
    spec = {k: v for k, v in _spec(name).items() if k not in ("hot", "tokens", "call")}
    return MoEConfig(d_model=D_MODEL, d_expert=D_EXPERT, seed=7, layer_id=3,
                     **{**spec, **overrides})


def make_layer(name: str, topo: Topology, **overrides) -> MoELayer:
    layer = MoELayer(make_config(name, **overrides), topo).double()
    hot = _spec(name).get("hot")
    if hot is not None:           # every token's first choice becomes expert `hot`
        with torch.no_grad():
            layer.router.weight[:, hot] += 10.0 * _hot_direction()
    return layer


def _hot_direction() -> torch.Tensor:
    return torch.ones(D_MODEL, dtype=torch.float64) / D_MODEL ** 0.5


def make_batch(name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_r, g_r): rank r's tokens and the weights of its local loss."""
    t = _spec(name).get("tokens", TOKENS)[rank]
    x = seeded_normal((t, D_MODEL), 1.0, "x", name, rank, dtype=torch.float64)
    if _spec(name).get("hot") is not None:
        x = x + 3.0 * _hot_direction()
    g = seeded_normal((t, D_MODEL), 1.0, "g", name, rank, dtype=torch.float64)
    return x, g


def local_loss(y: torch.Tensor, g: torch.Tensor, layer: MoELayer) -> torch.Tensor:
    return (y * g).sum() / max(1, y.shape[0]) + layer.aux_loss


def _snapshot(layer: MoELayer) -> tuple[dict, dict]:
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    torch.optim.SGD(layer.parameters(), lr=0.5).step()
    params = {n: p.detach().clone() for n, p in layer.named_parameters()}
    return grads, params


def run_rank(name: str, topo: Topology, before=None, **overrides) -> dict:
    """One case on this rank; ``overrides`` change MoEConfig fields that must not change the
    function (all-to-all algorithm, scheduler, pipelining degree); ``before(layer, x)`` runs
    ahead of the step (e.g. tuning)."""
    layer = make_layer(name, topo, **overrides)
    x, g = make_batch(name, topo.rank)
    if before is not None:
        before(layer, x)
    x.requires_grad_()
    y = layer(x, **_spec(name).get("call", {}))
    local_loss(y, g, layer).backward()
    sync_gradients(layer, topo)
    grads, params = _snapshot(layer)
    return {"y": y.detach(), "x_grad": x.grad, "aux": layer.aux_loss.detach(),
            "grads": grads, "params": params, "first_expert": layer.experts.first_expert,
            "num_local": layer.num_local,
            # bytes sent over inter-node links, forward and backward (None: not counted)
            "inter_node_bytes": layer.stats.get("inter_node_bytes")}


def rank_worker(names: list[str], ep_sizes: list[int]) -> dict:
    """On each rank of a launched job: every case under every expert-parallel size."""
    out = {}
    for ep in ep_sizes:
        topo = Topology.from_env(ep_size=ep)
        for name in names:
            out[(name, ep)] = run_rank(name, topo)
    return out


def variants_worker(names: list[str], variants: list[dict], local_size: int) -> dict:
    """Every case under every variant, on a world seen as nodes of ``local_size`` ranks."""
    topo = Topology.from_env(local_size=local_size)
    return {(name, i): run_rank(name, topo, **v) for i, v in enumerate(variants)
            for name in names}


def reference(name: str, world: int) -> dict:
    """One process, every expert, each rank's batch as its own local batch."""
    layer = make_layer(name, Topology.single())
    ys, xs, auxs, total = [], [], [], 0.0
    for r in range(world):
        x, g = make_batch(name, r)
        x.requires_grad_()
        y = layer(x, **_spec(name).get("call", {}))
        total = total + local_loss(y, g, layer)
        ys.append(y.detach())
        xs.append(x)
        auxs.append(layer.aux_loss.detach())
    (total / world).backward()
    grads, params = _snapshot(layer)
    return {"y": ys, "x_grad": [x.grad for x in xs], "aux": auxs, "grads": grads,
            "params": params}


TOL = dict(rtol=1e-9, atol=1e-12)


def assert_rank_matches(got: dict, ref: dict, rank: int, world: int, label: str = "") -> None:
    """Rank ``rank``'s outputs, input gradient (of its local loss: N times the reference's, which
    differentiates the mean), gradients and updated parameters (its expert shard) equal the
    reference's."""
    torch.testing.assert_close(got["y"], ref["y"][rank], **TOL)
    torch.testing.assert_close(got["aux"], ref["aux"][rank], **TOL)
    torch.testing.assert_close(got["x_grad"], world * ref["x_grad"][rank], **TOL)
    lo, n = got["first_expert"], got["num_local"]
    for what in ("grads", "params"):
        for pname, value in got[what].items():
            expect = ref[what][pname]
            if pname.startswith("experts."):
                expect = expect[lo:lo + n]
            torch.testing.assert_close(value, expect, **TOL, msg=lambda m: (
                f"{what} of {pname} on rank {rank} {label}: {m}"))
