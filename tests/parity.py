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
TOKENS = (6, 11, 3, 9)          # tokens on rank r (different per rank on purpose)

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
    # structures (BigMac): fine-grained and BigMac default to dropless routing
    "fine_grained_k4": dict(num_experts=8, top_k=4, structure="fine_grained"),
    "bigmac_k8": dict(num_experts=8, top_k=8, structure="bigmac"),       # r = 0.25: width 2
    "bigmac_swiglu_capacity": dict(num_experts=8, top_k=2, structure="bigmac",
                                   downscale_factor=0.5, capacity_factor=1.0,
                                   activation="swiglu"),
}


def make_config(name: str) -> MoEConfig:
    spec = {k: v for k, v in CASES[name].items() if k not in ("hot", "tokens")}
    return MoEConfig(d_model=D_MODEL, d_expert=D_EXPERT, seed=7, layer_id=3, **spec)


def make_layer(name: str, topo: Topology) -> MoELayer:
    layer = MoELayer(make_config(name), topo).double()
    hot = CASES[name].get("hot")
    if hot is not None:           # every token's first choice becomes expert `hot`
        with torch.no_grad():
            layer.router.weight[:, hot] += 10.0 * _hot_direction()
    return layer


def _hot_direction() -> torch.Tensor:
    return torch.ones(D_MODEL, dtype=torch.float64) / D_MODEL ** 0.5


def make_batch(name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_r, g_r): rank r's tokens and the weights of its local loss."""
    t = CASES[name].get("tokens", TOKENS)[rank]
    x = seeded_normal((t, D_MODEL), 1.0, "x", name, rank, dtype=torch.float64)
    if CASES[name].get("hot") is not None:
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


def run_rank(name: str, topo: Topology) -> dict:
    layer = make_layer(name, topo)
    x, g = make_batch(name, topo.rank)
    x.requires_grad_()
    y = layer(x)
    local_loss(y, g, layer).backward()
    sync_gradients(layer, topo)
    grads, params = _snapshot(layer)
    return {"y": y.detach(), "x_grad": x.grad, "aux": layer.aux_loss.detach(),
            "grads": grads, "params": params, "first_expert": layer.experts.first_expert,
            "num_local": layer.num_local}


def rank_worker(names: list[str], ep_sizes: list[int]) -> dict:
    """On each rank of a launched job: every case under every expert-parallel size."""
    out = {}
    for ep in ep_sizes:
        topo = Topology.from_env(ep_size=ep)
        for name in names:
            out[(name, ep)] = run_rank(name, topo)
    return out


def reference(name: str, world: int) -> dict:
    """One process, every expert, each rank's batch as its own local batch."""
    layer = make_layer(name, Topology.single())
    ys, xs, auxs, total = [], [], [], 0.0
    for r in range(world):
        x, g = make_batch(name, r)
        x.requires_grad_()
        y = layer(x)
        total = total + local_loss(y, g, layer)
        ys.append(y.detach())
        xs.append(x)
        auxs.append(layer.aux_loss.detach())
    (total / world).backward()
    grads, params = _snapshot(layer)
    return {"y": ys, "x_grad": [x.grad for x in xs], "aux": auxs, "grads": grads,
            "params": params}
